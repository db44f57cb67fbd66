"""`zerorun report`'s loss plot of a restarted job: each attempt its own line, the restart marked, the steps
that ran again drawn as what they are (the old plot joined them into one line that went backwards)."""

from __future__ import annotations

import pytest

from zerorun.telemetry import plots

pytest.importorskip("matplotlib")


def _step(rank: int, step: int, loss: float) -> dict:
    return {"type": "step", "rank": rank, "step": step, "loss": loss, "tokens_per_s": 100.0, "step_time_s": 0.1}


def _restarted_job() -> list[dict]:
    first = [_step(r, s, 5.0 - 0.1 * s) for s in range(6) for r in (0, 1)]
    second = [_step(r, s, 4.9 - 0.1 * s) for s in range(3, 8) for r in (0, 1)]
    return [{"type": "job", "job_id": "j1", "t": 0.0}, *first, {"type": "restart", "attempt": 1, "t": 1.0}, *second]


def test_attempts_cut_a_ranks_steps_where_a_restart_went_back() -> None:
    rows = [{"step": s} for s in (0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7)]
    assert [[r["step"] for r in run] for run in plots.attempts(rows)] == [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7]]


def test_the_loss_plot_marks_the_restart_and_fades_the_steps_run_again(tmp_path) -> None:
    from matplotlib.figure import Figure

    steps = plots._by_rank([plots.step_row(r) | {"_record": r} for r in _restarted_job() if r["type"] == "step"])
    fig = Figure()
    subtitle = plots._loss(fig, steps, {}, {0: "a", 1: "b"}, 0.0)
    loss_ax = fig.axes[0]
    curves = [line for line in loss_ax.get_lines() if len(line.get_xdata()) > 2]
    assert [list(line.get_xdata()) for line in curves] == [[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7]] * 2
    assert [line.get_alpha() for line in curves] == [0.35, 1.0, 0.35, 1.0]  # per rank: first attempt faded
    marks = [line for line in loss_ax.get_lines() if list(line.get_xdata()) == [3, 3]]
    assert len(marks) == 1 and "restart 1: resumed at step 3" in [t.get_text() for t in loss_ax.texts]
    assert "1 restart" in subtitle
    assert [p.name for p in plots.write_plots(_restarted_job(), tmp_path)] == ["loss.png", "time.png"]
