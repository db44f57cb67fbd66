"""The update: every param group's optimizer over what this rank owns (update.py), the way each needs (ways.py):
zerorun's fused Adam kernel or the script's elementwise optimizer over the flat shard (flat_step.py,
elementwise.py), or the script's optimizer on whole parameters owned per rank (owner_step.py, ownership.py);
the torch Optimizer face the script holds (optimizer.py), gradient clipping across shards, and the
learning-rate schedules (the engine's and DeepSpeed's formulas).

May import comm (the owner way gathers whole gradients and scatters the updated values back), offload (the
home it updates), runtime.store and runtime.memory; never a stage's store implementation, the engine or
checkpoints.
"""
