"""What `zerorun tune` shows and writes: the live table, the ranked table, the JSON, and tuned.yaml.

The ranked table puts the trials that can win first (measured and within the memory budget, fastest
first), then those measured over the budget, those stopped early, those that failed, and last the
candidates ruled out before running (one row per sharding). `write_tuned()` writes the user's
recipe with only the chosen keys changed, each with a `# tuned:` comment giving the measured
figure, and reads it back through `config.load` to prove it says what was measured. A gain over the
recipe is stated only as the interleaved runs' ratio with its spread (`noise.Comparison`); a winner
whose gain stayed inside the noise leaves the recipe as it is.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from zerorun import config, tables
from zerorun.tune import load, recipe_edit
from zerorun.tune.measure import Status, Trial
from zerorun.tune.space import Rejection, gib
from zerorun.tune.tuner import TuneOptions, TuneResult, tune

LIVE_REFRESH_S = 0.5
_ORDER = [Status.MEASURED, Status.OVER_BUDGET, Status.SLOWER, Status.OUT_OF_TIME, Status.STALLED, Status.INVALID,
          Status.OUT_OF_MEMORY, Status.FAILED]


def ranked(trials: Iterable[Trial]) -> list[Trial]:
    """Winners first (fastest first), then over budget, stopped, invalid and failed trials."""
    return sorted(trials, key=lambda t: (_ORDER.index(t.status), -(t.throughput or 0.0), t.index or 0))


# ---------------------------------------------------------------------------------------------
# Tables


def _columns(result: TuneResult) -> list[str]:
    budget = result.budget
    memory = [f"peak GPU/rank (budget {gib(budget.gpu_bytes)})"] if budget.gpu_bytes is not None else []
    rss_budget = "" if budget.gpu_bytes is not None else f" (budget {gib(budget.cpu_bytes_per_rank)})"
    unit = result.trials[0].unit if result.trials else "tokens/s"
    return ["trial", "configuration", "status", unit, "x best", *memory, f"peak RSS/rank{rss_budget}", "why"]


def _row(trial: Trial, best: Trial | None, gpu: bool) -> list[str]:
    ratio = f"{trial.throughput / best.throughput:.2f}" if trial.throughput and best else "-"
    memory = [gib(trial.peak_gpu) if trial.peak_gpu else "-"] if gpu else []
    rate = f"{trial.throughput:,.0f}" if trial.throughput else "-"
    if len(trial.runs) > 1:
        rate += f" (median of {len(trial.runs)})"
    return [f"t{trial.index:02d}", trial.candidate.label(), trial.status.value, rate, ratio, *memory,
            gib(trial.peak_rss) if trial.peak_rss else "-", _short(trial.cause)]


def _short(text: str, limit: int = 150) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _table(result: TuneResult) -> Table:
    """The tables' columns in the launch summary's compact style; the long text ones wrap."""
    table = tables.compact(_title(result))
    for col in _columns(result):
        table.add_column(col, justify="right" if col in ("x best",) or "/s" in col or "peak" in col else "left",
                         overflow="fold")
    return table


def _fitted(table: Table, width: int | None) -> RenderableType:
    """`table` fitted to `width` columns (tables.fit: the memory figures, then the ratio, go first)."""
    if width is None:
        return table
    drop = [str(c.header) for c in table.columns if str(c.header).startswith("peak")] + ["x best"]
    dropped = tables.fit(table, width, drop)
    return Group(table, Text(tables.dropped_note(dropped, width))) if dropped else table


def final_table(result: TuneResult) -> Table:
    """Every trial ranked, then the candidates ruled out before running."""
    gpu = result.budget.gpu_bytes is not None
    table = _table(result)
    best = result.winner
    for trial in ranked(result.trials):
        row = _row(trial, best, gpu)
        table.add_row(*row, style="bold" if trial is best else None)
    for label, reason in rejected_rows(result.rejected, result.dims.size // max(1, len(result.dims.shardings))):
        table.add_row("-", label, Status.REJECTED.value, "-", "-", *(["-"] if gpu else []), "-", reason)
    return table


def rejected_rows(rejections: list[Rejection], per_sharding: int) -> list[tuple[str, str]]:
    """One row per sharding: the variant closest to fitting and how many more were ruled out, or the
    sharding alone when all `per_sharding` of its variants were."""
    per: dict[tuple[int, str, str], list[Rejection]] = {}
    for r in rejections:
        per.setdefault(r.candidate.sharding, []).append(r)
    rows = []
    for group in per.values():
        first = min(group, key=lambda r: r.need or 0.0)
        if len(group) == per_sharding > 1:
            label = f"{first.candidate.sharding_label()} (all {len(group)} variants)"
        else:
            label = first.candidate.label() + (f" (+{len(group) - 1} more)" if len(group) > 1 else "")
        rows.append((label, first.reason))
    return rows


def live_view(result: TuneResult, width: int | None = None) -> RenderableType:
    """The trials so far (in run order) and the one running now, fitted to `width` columns where given."""
    gpu = result.budget.gpu_bytes is not None
    table = _table(result)
    best = result.winner
    for trial in result.trials:
        table.add_row(*_row(trial, best, gpu))
    current = result.current
    if current is not None:
        row = _row(current, best, gpu)
        row[2] = f"running ({current.phase})" if current.steps == 0 else f"measuring: {current.steps} step(s)"
        table.add_row(*row, style="cyan")
    return _fitted(table, width)


def _title(result: TuneResult) -> str:
    b = result.budget
    layout = f"{b.nodes} node(s) x {b.ranks_per_node} rank(s)"
    clock = f"{result.elapsed_s / 60:.1f} of {result.budget_s / 60:g} min"
    return f"zerorun tune {result.recipe}: {layout}, {clock}, {len(result.trials)} trial(s)"


def summary(result: TuneResult, tuned_path: str | None) -> list[str]:
    """The verdict and the notes, one line each."""
    lines = [verdict(result)]
    loaded = load.summary(result.loads)
    if loaded:
        lines.append(f"Load: {loaded}")
    if tuned_path:
        lines.append(f"Wrote {tuned_path}: `zerorun launch {tuned_path}` trains with it.")
    untried = result.dims.size - len(result.trials) - len(result.rejected)
    if untried > 0:
        lines.append(f"{untried} of the {result.dims.size} candidates were not run: the search did not need them "
                     "(or the budget ended first; see the notes).")
    lines.append(f"Trials: {result.tune_dir}/ (telemetry and output of each; tune.json)")
    return lines + [f"Note: {n}" for n in result.notes]


def verdict(result: TuneResult) -> str:
    """What the tuning found, claiming a gain over the recipe only from interleaved runs that show it."""
    win, base, comparison = result.winner, result.baseline, result.comparison
    if win is None:
        return "No candidate was measured within the memory budget: see the table's last column."
    if win is base:
        return (f"Fastest that fits: your recipe as it is, t{win.index:02d} {win.candidate.label()}: "
                f"{win.throughput:,.0f} {win.unit}.")
    found = f"t{win.index:02d} {win.candidate.label()}: {win.throughput:,.0f} {win.unit}"
    if comparison is None:  # the recipe did not measure within the budget
        return f"Fastest that fits: {found}."
    if comparison.supported:
        return f"Fastest that fits: {found}, {comparison.text()} your recipe."
    if comparison.ratios:
        return (f"No gain over your recipe beyond the noise: {found} measured {comparison.text()} your recipe; "
                "your recipe stays as it is.")
    return (f"No gain over your recipe claimed: {found} was not compared with it in interleaved runs (the time "
            "budget ended first; raise --budget-min); your recipe stays as it is.")


# ---------------------------------------------------------------------------------------------
# JSON


def trial_json(t: Trial) -> dict[str, Any]:
    data = dataclasses.asdict(t)
    data.update(status=t.status.value, label=t.candidate.label(), samples_per_step=sorted(t.samples_per_step))
    return data


def as_json(result: TuneResult, tuned_path: str | None = None) -> dict[str, Any]:
    trial = trial_json
    win, comparison = result.winner, result.comparison
    return {"recipe": result.recipe, "tuned": tuned_path, "budget_s": result.budget_s, "elapsed_s": result.elapsed_s,
            "budget": dataclasses.asdict(result.budget), "baseline": dataclasses.asdict(result.base),
            "winner": trial(win) if win else None,
            "chosen": trial(result.chosen) if result.chosen else None,
            "vs_recipe": {"ratios": list(comparison.ratios), "supported": comparison.supported}
            if comparison else None, "trials": [trial(t) for t in ranked(result.trials)],
            "rejected": [{"candidate": dataclasses.asdict(r.candidate), "label": r.candidate.label(),
                          "reason": r.reason, "need_bytes": r.need} for r in result.rejected],
            "notes": result.notes, "interrupted": result.interrupted,
            "space": {"shardings": result.dims.shardings, "micro_batches": result.dims.micro_batches,
                      "checkpointing": result.dims.checkpointing, "bucket_mb": result.dims.bucket_mb,
                      "size": result.dims.size},
            "tune_dir": result.tune_dir}


# ---------------------------------------------------------------------------------------------
# tuned.yaml


def tuned_changes(result: TuneResult, nvme_path: str | None) -> dict[str, tuple[Any, str]]:
    """The keys the chosen trial changes in the recipe, each with the comment that says what it measured (a
    gain over the recipe only as the interleaved runs supported it)."""
    win, comparison = result.chosen, result.comparison
    if win is None:
        return {}
    figure = f"t{win.index:02d} measured {win.throughput:,.0f} {win.unit}"
    if comparison is not None and comparison.supported:
        figure += f" = {comparison.text()} the recipe"
    if win.peak_rss:
        figure += f", peak RSS {gib(win.peak_rss)}/rank"
    if win.peak_gpu:
        figure += f", GPU {gib(win.peak_gpu)}/rank"
    before = result.base.settings()
    changes = {key: (value, f"was {recipe_edit.scalar(before[key])}; {figure}")
               for key, value in win.candidate.settings().items() if value != before[key]}
    for kind in ("offload_optimizer", "offload_param"):
        if f"zero.{kind}.device" in changes and changes[f"zero.{kind}.device"][0] == "nvme" and nvme_path:
            changes[f"zero.{kind}.nvme_path"] = (nvme_path, "where the tuning's NVMe trials ran")
    return changes


def write_tuned(result: TuneResult, out: str | Path, nvme_path: str | None) -> Path | None:
    """Write the recipe with the chosen trial's keys to `out`; None (nothing written) without one."""
    win = result.chosen
    if win is None:
        return None
    out = Path(out)
    source = Path(result.recipe)
    text = source.read_text()
    changes = {**tuned_changes(result, nvme_path), **_moved_paths(text, source, out)}
    own = "; your recipe's own configuration" if win.candidate == result.base else ""
    header = (f"# Tuned by `zerorun tune` on {time.strftime('%Y-%m-%d %H:%M')} from {source}: "
              f"{win.candidate.label()}, t{win.index:02d} {win.throughput:,.0f} {win.unit}{own}.\n"
              f"# Every trial: {result.tune_dir}/tune.json\n")
    if win.candidate.stage != result.base.stage:
        text = recipe_edit.restate_stage(text, result.base.stage, win.candidate.stage)
    try:
        edited = header + recipe_edit.set_keys(text, changes)
    except (ValueError, yaml.YAMLError):  # a layout the text editor does not handle: plain YAML, no comments
        edited = header + "# (the original's comments could not be kept)\n" + _dumped(text, changes)
    out.write_text(edited)
    check = config.load(out)
    for key, value in win.candidate.settings().items():
        got = _get(check, key)
        assert got == value, f"{out}: {key} reads back as {got!r}, not the winner's {value!r}"
    return out


def _moved_paths(text: str, source: Path, out: Path) -> dict[str, tuple[Any, str]]:
    """`script`/`hostfile` are relative to the recipe file: rewritten for a tuned file in another directory."""
    here, there = source.resolve().parent, out.resolve().parent
    if here == there:
        return {}
    data = yaml.safe_load(text) or {}
    moved = {}
    for key in ("script", "hostfile"):
        value = data.get(key)
        if isinstance(value, str) and not os.path.isabs(value):
            target = here / value
            near = os.path.commonpath([here, there]) != os.path.sep
            moved[key] = (os.path.relpath(target, there) if near else str(target), f"was {value}, from {source}")
    return moved


def _dumped(text: str, changes: dict[str, tuple[Any, str]]) -> str:
    data = yaml.safe_load(text) or {}
    for key, (value, _) in changes.items():
        node, parts = data, key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                short = config.shorthand_of(".".join(parts[: i + 1]))
                child = {short: child} if short and child is not None else {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return yaml.safe_dump(data, sort_keys=False)


def _get(recipe: config.Recipe, key: str) -> Any:
    value: Any = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return value


def tune_with_progress(recipe: str | Path, options: TuneOptions, live: bool, err: Console) -> TuneResult:
    """The whole tuning of `recipe` (`tuner.tune`), shown as it goes: a live table on `err` (a terminal),
    or else one line per finished trial there."""
    if not live:
        shown = 0
        line = trial_line(err)

        def lines(result: TuneResult) -> None:
            nonlocal shown
            for trial in result.trials[shown:]:
                line(trial)
            shown = len(result.trials)

        return tune(recipe, options, lines)
    refreshed = 0.0
    with Live(console=err, auto_refresh=False, transient=True) as view:
        def refresh(result: TuneResult) -> None:
            nonlocal refreshed
            if time.monotonic() - refreshed >= LIVE_REFRESH_S or result.current is None:
                view.update(live_view(result, err.width), refresh=True)
                refreshed = time.monotonic()

        return tune(recipe, options, refresh)


def trial_line(err: Console) -> Callable[[Trial], None]:
    """A function printing one line per finished trial on `err` (where there is no live table)."""
    def line(trial: Trial) -> None:
        rate = f" {trial.throughput:,.0f} {trial.unit}" if trial.throughput else ""
        peak = f", peak RSS {gib(trial.peak_rss)}/rank" if trial.peak_rss else ""
        why = f": {trial.cause}" if trial.cause else ""
        err.print(f"zerorun tune: t{trial.index:02d} ({trial.phase}) {trial.candidate.label()}: {trial.status.value}"
                  f"{rate}{peak}{why}", markup=False, highlight=False, soft_wrap=True)

    return line


def render_final(result: TuneResult, tuned_path: str | None, width: int | None = None) -> RenderableType:
    """The ranked table (fitted to `width` columns where given) and the verdict with the notes."""
    return Group(_fitted(final_table(result), width), *(Text(line) for line in summary(result, tuned_path)))

