"""The manual sweep that checks the tuner: every candidate of the same space, measured fully.

    sweep = run_sweep("recipe.yaml", options, rounds=2)      # what `zerorun tune --sweep 2` adds
    verdict(sweep, tune_result)                             # the tuner's winner against the sweep's best

No search and no early stopping: every candidate the estimate lets through (the same pruning, the
same budget, the same trial runner and measurement as the tuner) runs `rounds` times, each round in
its own shuffled order (seeded: the same order on every run), and is ranked by its median.

A shared machine drifts: while other jobs move the load, the same configuration measures slower or
faster an hour later, and blocks of consecutive trials rise and fall together (docs/benchmarks.md's
Tuner section shows a sweep's drift). So the recipe's own configuration is run again every `REFERENCE_EVERY` candidates and each
trial is scaled by the reference's median over its level at that time (interpolated between the
reference runs around it), as `zerorun bench step` reports ratios to DDP within a round. The table
shows the corrected and the raw medians.

Then the tuner's winner, as the sweep measured it, is compared with the sweep's best: the tuner did
its job if the ratio is close to 1 (the bar: within 5%).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from zerorun import tables
from zerorun.tune.measure import Status, Trial
from zerorun.tune.output import ranked, trial_json
from zerorun.tune.space import Candidate, gib
from zerorun.tune.tuner import Session, TuneOptions, TuneResult, prepare

REFERENCE_EVERY = 6  # the recipe's own configuration runs again after this many candidates


@dataclass
class SweepRow:
    """One candidate's trials in the sweep, and their throughputs corrected for the machine's drift."""

    candidate: Candidate
    trials: list[Trial] = field(default_factory=list)
    corrected: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float | None:
        """The median of the corrected throughputs (the raw ones where there is no reference)."""
        values = self.corrected or [t.throughput for t in self.trials if t.ok and t.throughput]
        return statistics.median(values) if values else None

    @property
    def raw(self) -> float | None:
        values = [t.throughput for t in self.trials if t.ok and t.throughput]
        return statistics.median(values) if values else None

    @property
    def peak_rss(self) -> int | None:
        return max((t.peak_rss for t in self.trials if t.peak_rss), default=None)

    @property
    def status(self) -> Status:
        """MEASURED if any round measured it within the budget, else the first round's status."""
        return Status.MEASURED if self.throughput is not None else ranked(self.trials)[0].status

    @property
    def cause(self) -> str:
        return next((t.cause for t in self.trials if t.cause), "")


@dataclass
class Sweep:
    rows: list[SweepRow]
    session: Session
    rounds: int
    reference: Candidate | None  # run every REFERENCE_EVERY candidates; None: not drift-corrected
    interrupted: bool = False  # Ctrl-C: the rows are what was measured until then

    @property
    def best(self) -> SweepRow | None:
        return max((r for r in self.rows if r.throughput), key=lambda r: r.throughput, default=None)

    def row(self, candidate: Candidate) -> SweepRow | None:
        return next((r for r in self.rows if r.candidate == candidate), None)

    def correct(self) -> None:
        """Scale every measured trial by (the reference's median) / (the reference's level when it ran)."""
        ref = self.row(self.reference) if self.reference is not None else None
        points = sorted((t.ended_at, t.throughput) for t in (ref.trials if ref else []) if t.ok and t.throughput)
        if len(points) < 2:
            self.reference = None
            return
        typical = statistics.median(v for _, v in points)
        for row in self.rows:
            row.corrected = [t.throughput * typical / level(points, t.ended_at)
                             for t in row.trials if t.ok and t.throughput]


def level(points: list[tuple[float, float]], at: float) -> float:
    """The reference's throughput at time `at`: linear between the runs around it, flat beyond the ends."""
    if at <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if at <= t1:
            return v0 + (v1 - v0) * (at - t0) / (t1 - t0) if t1 > t0 else v1
    return points[-1][1]


def run_sweep(recipe_path: str | Path, options: TuneOptions, rounds: int,
              progress: Callable[[Trial], None] = lambda trial: None) -> Sweep:
    """Measure every candidate that the estimate lets through, `rounds` times, each round shuffled, with the
    recipe's configuration run again every REFERENCE_EVERY candidates as the measure of the machine's drift."""
    session = prepare(recipe_path, options, kind="sweep")
    candidates = _ordered(session)
    reference = session.base if session.base in candidates else None
    rows = {c: SweepRow(c) for c in candidates}

    def measure(candidate: Candidate, phase: str) -> None:
        if candidate not in session.kept and candidate != session.base:
            return  # ruled out once the first trial told the estimate the parameter count
        index = 1 + sum(len(row.trials) for row in rows.values())
        trial = session.runner.run(candidate, index, phase, lambda records: None)
        session.judge(trial)
        rows[candidate].trials.append(trial)
        session.learn_params(trial, [t.candidate for row in rows.values() for t in row.trials])
        progress(trial)

    interrupted = False
    try:
        for round_index in range(rounds):
            order = [c for c in candidates if c != reference]
            random.Random(round_index).shuffle(order)  # drift must not follow the expected-speed order
            for position, candidate in enumerate(order):
                if reference is not None and position % REFERENCE_EVERY == 0:
                    measure(reference, "reference")
                measure(candidate, f"sweep {round_index + 1}/{rounds}")
            if reference is not None:
                measure(reference, "reference")
    except KeyboardInterrupt:
        interrupted = True
    sweep = Sweep([r for r in rows.values() if r.trials], session, rounds, reference, interrupted)
    sweep.correct()
    return sweep


def _ordered(session: Session) -> list[Candidate]:
    """The recipe's own configuration first, then the space in its expected-speed order."""
    rejected = {r.candidate for r in session.rejected}
    first = [] if session.base in rejected else [session.base]
    return first + [c for c in session.kept if c != session.base]


def verdict(sweep: Sweep, tuned: TuneResult) -> str:
    """One line: the tuner's winner as the sweep measured it, against the sweep's best."""
    best, win = sweep.best, tuned.winner
    if best is None:
        return "The sweep measured no candidate within the budget."
    if win is None:
        return f"The tuner found no winner; the sweep's best is {best.candidate.label()} ({best.throughput:,.0f})."
    row = sweep.row(win.candidate)
    if row is None or row.throughput is None:
        why = row.cause if row else "not in the sweep's space"
        return f"The tuner's winner {win.candidate.label()} did not measure in the sweep ({why})."
    ratio = row.throughput / best.throughput
    return (f"The tuner's winner {win.candidate.label()} measures {row.throughput:,.0f} in the sweep = {ratio:.3f} x "
            f"the sweep's best, {best.candidate.label()} ({best.throughput:,.0f}): "
            f"{'within' if ratio >= 0.95 else 'NOT within'} 5%.")


def table(sweep: Sweep, tuned: TuneResult | None = None, width: int | None = None) -> RenderableType:
    """The sweep's candidates, fastest first (median over the rounds), fitted to `width` columns where given."""
    best = sweep.best
    unit = next((t.unit for r in sweep.rows for t in r.trials), "tokens/s")
    budget = sweep.session.budget
    title = (f"manual sweep: {len(sweep.rows)} candidates x {sweep.rounds} round(s), every one measured fully "
             "(no search, no early stopping)" + (f"; reference: {sweep.reference.label()}, run every "
                                                 f"{REFERENCE_EVERY} candidates" if sweep.reference else ""))
    out = tables.compact(title)
    corrected = "drift-corrected median" if sweep.reference is not None else "median, not drift-corrected"
    for col in ("#", "configuration", "status", f"{unit} ({corrected})", "raw median", "x best", "runs",
                f"peak RSS/rank (budget {gib(budget.cpu_bytes_per_rank)})", "tuner", "why"):
        out.add_column(col, justify="right" if col in ("#", "x best", "rounds") or "/" in col else "left",
                       overflow="fold")
    winner = tuned.winner.candidate if tuned and tuned.winner else None
    rows = sorted(sweep.rows, key=lambda r: (r.throughput is None, -(r.throughput or 0.0)))
    for rank, row in enumerate(rows, 1):
        measured = [t for t in row.trials if t.ok]
        out.add_row(str(rank), row.candidate.label(), row.status.value,
                    f"{row.throughput:,.0f}" if row.throughput else "-", f"{row.raw:,.0f}" if row.raw else "-",
                    f"{row.throughput / best.throughput:.3f}" if row.throughput and best else "-",
                    f"{len(measured)}/{len(row.trials)}", gib(row.peak_rss) if row.peak_rss else "-",
                    "winner" if row.candidate == winner else "", row.cause[:100],
                    style="bold" if row.candidate == winner else None)
    if width is None:
        return out
    dropped = tables.fit(out, width, ["raw median", "runs", f"peak RSS/rank (budget {gib(budget.cpu_bytes_per_rank)})",
                                      "x best"])
    return Group(out, Text(tables.dropped_note(dropped, width))) if dropped else out


def as_json(sweep: Sweep, tuned: TuneResult | None = None) -> dict[str, Any]:
    best = sweep.best
    return {"rounds": sweep.rounds, "verdict": verdict(sweep, tuned) if tuned else None,
            "interrupted": sweep.interrupted,
            "best": asdict(best.candidate) if best else None,
            "reference": asdict(sweep.reference) if sweep.reference else None,
            "rows": [{"candidate": asdict(r.candidate), "label": r.candidate.label(), "status": r.status.value,
                      "throughput": r.throughput, "raw_throughput": r.raw, "corrected": r.corrected,
                      "peak_rss": r.peak_rss, "trials": [trial_json(t) for t in r.trials]}
                     for r in sweep.rows]}
