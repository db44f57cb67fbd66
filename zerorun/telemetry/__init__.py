"""Live telemetry: each rank streams JSON lines to the launcher, which shows and records them.

- `probe` (worker): a background thread per rank; samples memory, throughput and where the
  training thread is; never blocks or breaks training.
- `collector` (launcher): a TCP server; keeps the latest state per rank (`state.RunState`) and
  appends every record to `runs/<name>/telemetry.jsonl`.
- `console` renders that state (live table, plain summary lines, final summary); `report`
  re-renders a JSONL file, and `plots` draws it as PNGs; `series` flattens records into the rows
  that CSV, TensorBoard (`trackers`, written live by the launcher) and the plots share.
- `zerorun.launch.monitor` plugs collector, console and stall detection into the supervisor
  (telemetry knows nothing of launching; the launcher composes it).

The wire protocol is one JSON object per line; every record has `type`, and every worker record
has `rank` and `t` (the worker's wall clock). See `probe` for the record types.

This `__init__` stays import-free: the worker bootstrap reads `ADDRESS_ENV` before importing torch.
"""

ADDRESS_ENV = "ZERORUN_TELEMETRY"  # host:port of the launcher's collector, set in every worker's environment
RUNS_DIR = "runs"  # runs/<name>/telemetry.jsonl, relative to where the launcher runs
