"""The update: AdamStep (the one path from the home's tiles through the fused kernel to each
parameter's target), the torch Optimizer face the user's script holds (ShardedAdamW), gradient
clipping across shards, and the learning-rate schedules (the engine's and DeepSpeed's formulas).

May import offload (the home it updates), runtime.store and runtime.memory; never a stage's store
implementation, the engine or checkpoints.
"""
