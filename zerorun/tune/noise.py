"""Whether the tuner's winner is faster than the recipe: interleaved runs, their ratio and its spread.

A first baseline run taken while the machine was busy, against a winner measured in a quiet minute,
shows a gain that runs taken alternately afterwards do not. A gain is a claim about the candidate, not
about the minute it ran in, so it is only made from runs taken side by side:

    next_run(baseline, winner, last_index)   # after the search: the recipe and the winner in turn, B W B W
    compare(baseline, winner)                # Comparison(ratios=(1.02, 0.97, 1.05)): one per adjacent pair

A pair is two runs of consecutive trial numbers (one of each), so both met the same load. The gain is
supported when every pair's ratio is above 1 + `NOISE_FLOOR`; otherwise it is inside the noise, and the
tuned recipe stays the user's own (`Comparison.supported`). Pure: trials in, decisions out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from zerorun.tune.measure import Trial
from zerorun.tune.space import Candidate

PAIRS = 2  # interleaved (recipe, winner) pairs before a gain is claimed or refused
NOISE_FLOOR = 0.03  # every pair must show the winner this much faster (one step's spread on a quiet machine)


@dataclass(frozen=True)
class Comparison:
    """The winner's throughput over the recipe's, one ratio per interleaved pair of runs."""

    ratios: tuple[float, ...]

    @property
    def supported(self) -> bool:
        """Whether every pair shows the winner faster by more than the noise."""
        return len(self.ratios) >= PAIRS and min(self.ratios) > 1 + NOISE_FLOOR

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def text(self) -> str:
        """`1.31x (1.22-1.40 over 2 interleaved pairs)`."""
        if not self.ratios:
            return "not compared in interleaved runs"
        n = len(self.ratios)
        spread = f"{min(self.ratios):.2f}-{max(self.ratios):.2f} over " if n > 1 else ""
        return f"{self.median:.2f}x ({spread}{n} interleaved pair{'s' if n > 1 else ''})"


def runs(trial: Trial) -> list[tuple[int, float]]:
    """(trial number, throughput) of every measured run of a candidate, in run order."""
    if trial.index is None or not trial.ok:
        return []
    numbers = [trial.index, *trial.repeats]
    values = trial.runs or [trial.throughput or 0.0]
    return list(zip(numbers, values, strict=False))


def compare(baseline: Trial, winner: Trial) -> Comparison:
    """The ratio of each pair of adjacent runs (one of each), pairs not sharing a run."""
    timeline = sorted([(n, v, False) for n, v in runs(baseline)] + [(n, v, True) for n, v in runs(winner)])
    ratios, i = [], 0
    while i + 1 < len(timeline):
        (n0, v0, w0), (n1, v1, w1) = timeline[i], timeline[i + 1]
        if n1 == n0 + 1 and w0 != w1 and v0 > 0 and v1 > 0:
            ratios.append((v1 / v0) if w1 else (v0 / v1))
            i += 2
        else:
            i += 1
    return Comparison(tuple(ratios))


def next_run(baseline: Trial, winner: Trial, last_index: int) -> Candidate | None:
    """The next run of the interleaving (the recipe, then the winner, or the reverse when the winner ran
    last), or None once `PAIRS` pairs are measured or there is nothing to compare."""
    if baseline is winner or not baseline.ok or not winner.ok or len(compare(baseline, winner).ratios) >= PAIRS:
        return None
    ran_last = next((t for t in (baseline, winner) if last_index in (t.index, *t.repeats)), None)
    return winner.candidate if ran_last is baseline else baseline.candidate
