"""The manual sweep's arithmetic: drift correction against the reference runs, and the verdict."""

from __future__ import annotations

import pytest

from zerorun.tune.measure import Status, Trial
from zerorun.tune.space import Budget, Candidate, Dimensions
from zerorun.tune.sweep import Sweep, SweepRow, level, verdict
from zerorun.tune.tuner import TuneResult

REF = Candidate(2, "none", "none", 2, 1, False, 25.0)
FAST = Candidate(0, "none", "none", 2, 1, False, 25.0)
SLOW = Candidate(3, "none", "none", 2, 1, False, 25.0)


def _run(candidate: Candidate, throughput: float, at: float) -> Trial:
    return Trial(candidate, Status.MEASURED, throughput=throughput, ended_at=at)


def test_the_reference_level_is_interpolated_between_its_runs_and_flat_beyond() -> None:
    points = [(10.0, 100.0), (20.0, 50.0), (30.0, 50.0)]
    assert [level(points, t) for t in (0.0, 10.0, 15.0, 20.0, 25.0, 99.0)] == [100.0, 100.0, 75.0, 50.0, 50.0, 50.0]


def test_drift_is_divided_out_so_that_a_candidate_measured_in_a_slow_hour_still_ranks_first() -> None:
    # the machine halves its speed between t=10 and t=20: FAST (1.2x the reference) runs in the slow part,
    # SLOW (0.9x) in the fast part; raw, SLOW looks faster
    rows = [SweepRow(REF, [_run(REF, 100.0, 0.0), _run(REF, 100.0, 10.0), _run(REF, 50.0, 20.0),
                           _run(REF, 50.0, 30.0)]),
            SweepRow(FAST, [_run(FAST, 60.0, 25.0)]), SweepRow(SLOW, [_run(SLOW, 90.0, 5.0)])]
    sweep = Sweep(rows, None, 1, REF)
    assert sweep.row(SLOW).raw > sweep.row(FAST).raw
    sweep.correct()
    typical = 75.0  # the reference's median
    assert sweep.row(FAST).throughput == pytest.approx(60.0 * typical / 50.0)
    assert sweep.row(SLOW).throughput == pytest.approx(90.0 * typical / 100.0)
    assert sweep.best.candidate == FAST


def test_without_two_reference_runs_the_sweep_says_it_is_not_corrected() -> None:
    sweep = Sweep([SweepRow(REF, [_run(REF, 100.0, 0.0)]), SweepRow(FAST, [_run(FAST, 60.0, 5.0)])], None, 1, REF)
    sweep.correct()
    assert sweep.reference is None and sweep.best.candidate == REF and sweep.row(FAST).throughput == 60.0


def test_the_verdict_compares_the_tuners_winner_as_the_sweep_measured_it() -> None:
    sweep = Sweep([SweepRow(REF, [_run(REF, 100.0, 0.0)]), SweepRow(FAST, [_run(FAST, 104.0, 5.0)])], None, 1, None)
    dims = Dimensions(((2, "none", "none"),), ((2, 1),), (False,), (25.0,))
    tuned = TuneResult("r.yaml", REF, Budget(2, 1, 2**33), dims, 60.0, "runs/r/tune-x",
                       [Trial(REF, Status.MEASURED, index=1, throughput=120.0)])
    assert verdict(sweep, tuned).endswith("= 0.962 x the sweep's best, stage 0, micro 2 x 1, bucket 25 (104): "
                                          "within 5%.")
    sweep.rows[1].trials[0].throughput = 110.0
    assert "= 0.909 x" in verdict(sweep, tuned) and verdict(sweep, tuned).endswith("NOT within 5%.")
