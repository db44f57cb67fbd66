"""`zerorun tune`: the command's flags, the tuning with its progress, the tuned recipe and the sweep.

Kept apart from `cli/app.py` as `cli/bench.py` is; the work happens in `zerorun.tune` (imported when run).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from zerorun.errors import ZerorunError

if TYPE_CHECKING:
    from rich.console import Console

    from zerorun.tune.tuner import TuneOptions, TuneResult


def _numbers(flag: str, text: str | None, kind: type) -> tuple:
    """`1,2,4` -> (1, 2, 4); a clear error for anything else."""
    if not text:
        return ()
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ZerorunError(f"{flag}: expected comma-separated {kind.__name__}s, got {text!r}.") from None


def tune(
    recipe: Annotated[Path, typer.Argument(help="The recipe YAML file: your script, nodes and data.",
                                           show_default=False)],
    budget_min: Annotated[float, typer.Option(help="Wall-clock minutes for the whole tuning.")] = 10.0,
    out: Annotated[Path | None, typer.Option(help="Where to write the tuned recipe (default: RECIPE's "
                                                  "directory, <stem>.tuned.yaml).")] = None,
    gpu_mem: Annotated[float | None, typer.Option(help="Memory budget of one GPU, GiB (default: the GPU's).")] = None,
    cpu_mem: Annotated[float | None, typer.Option(help="Memory budget of one node, GiB (default: this machine's); "
                                                       "on a CPU-only job each rank gets its share.")] = None,
    nvme_path: Annotated[str | None, typer.Option(help="Directory for NVMe-offload trials (without it, and without "
                                                       "one in the recipe, NVMe candidates are rejected).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model factory module:function, so the estimate prunes before the first trial (default: the first "
             "trial's parameter count).")] = None,
    micro_batches: Annotated[str | None, typer.Option(
        help="Micro-batches to try, e.g. 1,2,4 (default: the divisors of the per-rank batch, so the global batch "
             "stays).")] = None,
    allow_batch_change: Annotated[bool, typer.Option(
        "--allow-batch-change", help="Let the global batch change: micro-batches from 1/4 to 4x the recipe's, "
                                     "same accumulation.")] = False,
    bucket_mb: Annotated[str | None, typer.Option(help="Gradient bucket sizes to try, MiB (default: the recipe's, "
                                                       "1/4 and 4x of it).")] = None,
    stages: Annotated[str, typer.Option(help="ZeRO stages to try.")] = "0,1,2,3",
    offloads: Annotated[str, typer.Option(help="Offload devices to try.")] = "none,cpu,nvme",
    warmup: Annotated[int, typer.Option(help="Steps per trial left out of the measurement.")] = 1,
    steps: Annotated[int, typer.Option(help="Measured steps per trial (at least 2 s of them).")] = 3,
    sweep: Annotated[int, typer.Option(help="Then measure every candidate fully this many times (no search, no "
                                            "early stopping) and compare the winner with the sweep's best.")] = 0,
    hostfile: Annotated[str | None, typer.Option(help="DeepSpeed-style hostfile (overrides the recipe's).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE",
                                                      help="Override a recipe key in every trial.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON (no tables).")] = False,
) -> None:
    """Measure stage, offload, micro-batch, checkpointing and bucket size on your job; write the fastest that fits."""
    from zerorun import tables
    from zerorun.tune.tuner import TuneOptions

    if warmup < 0 or steps < 1 or budget_min <= 0 or sweep < 0:
        raise ZerorunError("--warmup and --sweep must be >= 0, --steps >= 1 and --budget-min > 0.")
    options = TuneOptions(budget_min, gpu_mem, cpu_mem, nvme_path, allow_batch_change,
                          _numbers("--micro-batches", micro_batches, int), _numbers("--bucket-mb", bucket_mb, float),
                          _numbers("--stages", stages, int), tuple(o.strip() for o in offloads.split(",") if o.strip()),
                          model, warmup, steps, overrides=tuple(set_ or ()),
                          launch_options={"hostfile": hostfile} if hostfile else {})
    err = tables.console(stderr=True)
    result, tuned, report = _tune_and_write(recipe, options, out, as_json, err)
    interrupted = result.interrupted
    if sweep > 0 and not interrupted:
        interrupted = _sweep(recipe, options, sweep, result, report, as_json, err)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    if interrupted:
        raise typer.Exit(130)
    if tuned is None:
        raise typer.Exit(1)


def _tune_and_write(recipe: Path, options: TuneOptions, out: Path | None, as_json: bool,
                    err: Console) -> tuple[TuneResult, Path | None, dict[str, Any]]:
    """Tune (progress on `err`), write the tuned recipe and tune.json; (result, tuned recipe or None, report)."""
    from zerorun import tables
    from zerorun.tune import output

    # Ctrl-C ends the tuning as it ends a launch, even where SIGINT came ignored (a shell's background
    # job): each trial's launcher handles SIGINT itself, so a tuner that ignored it would see its trial
    # stop, record it as failed and go on to the next
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result = output.tune_with_progress(recipe, options, live=err.is_terminal and not as_json, err=err)
    target = out or recipe.with_name(f"{recipe.stem}.tuned.yaml")
    tuned = output.write_tuned(result, target, options.nvme_path)
    report = output.as_json(result, str(tuned) if tuned else None)
    Path(result.tune_dir, "tune.json").write_text(json.dumps(report, indent=2))
    if not as_json:
        shown = tables.console()
        shown.print(output.render_final(result, str(tuned) if tuned else None, shown.width))
    return result, tuned, report


def _sweep(recipe: Path, options: TuneOptions, rounds: int, result: TuneResult, report: dict, as_json: bool,
           err: Console) -> bool:
    """`tune --sweep N`: every candidate measured `rounds` times, the tuner's winner checked against the
    best; the sweep goes into `report` and sweep.json. Returns whether Ctrl-C ended it."""
    from zerorun import tables
    from zerorun.tune import output
    from zerorun.tune import sweep as manual

    checked = manual.run_sweep(recipe, options, rounds, progress=output.trial_line(err))
    report["sweep"] = manual.as_json(checked, result)
    Path(checked.session.runner.setup.tune_dir, "sweep.json").write_text(json.dumps(report["sweep"], indent=2))
    if not as_json:
        out = tables.console()
        out.print(manual.table(checked, result, out.width))
        typer.echo(manual.verdict(checked, result))
    return checked.interrupted
