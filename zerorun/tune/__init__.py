"""`zerorun tune`: the fastest configuration that fits, measured on the user's own job.

- `space`: the candidates (stage x offload x micro-batch x activation checkpointing x bucket size)
  and their pruning by `zerorun.estimate` and the memory budget; pure.
- `search`: which candidate to measure next, given the results so far; pure.
- `measure`: a trial's throughput and peak memory from its telemetry records; pure.
- `trial`: one candidate run for a few steps through the normal launcher (`guard`), watched live.
- `tuner`: the loop, the time budget and early stopping.
- `output` and `recipe_edit`: the tables, the JSON, and tuned.yaml (the recipe, comments kept).

Nothing below `cli` imports this package.
"""
