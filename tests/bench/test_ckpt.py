"""`zerorun bench ckpt` runs its modes in rotated rounds on a tiny model and reports stalls, writes and ratios.

Plumbing only (which windows, which records, which columns): the figures themselves are the benchmark's
business."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zerorun.cli import app

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--vocab", "64", "--seq-len", "8"]


@pytest.mark.slow
def test_bench_ckpt_rotates_the_modes_each_round_and_reports_every_save(tmp_path):
    out = tmp_path / "ckpt.json"
    result = CliRunner().invoke(app, ["bench", "ckpt", *TINY, "--rounds", "3", "--every", "2", "--dir", str(tmp_path),
                                      "--modes", "none,sync,async,async-nice19", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    order = [[w["mode"] for w in data["windows"] if w["round"] == r] for r in range(3)]
    assert order == [["none", "sync", "async", "async-nice19"], ["sync", "async", "async-nice19", "none"],
                     ["async", "async-nice19", "none", "sync"]]
    assert all(len(w["step_s"]) == 2 for w in data["windows"])
    by_mode = {m: [s for s in data["saves"] if s["bench_mode"] == m] for m in ("sync", "async", "async-nice19")}
    assert [len(saves) for saves in by_mode.values()] == [3, 3, 3]  # one per window; the warm-up save apart
    assert {s["mode"] for s in by_mode["sync"]} == {"sync"} and {s["mode"] for s in by_mode["async"]} == {"async"}
    assert data["warmup_save"]["mode"] == "async" and by_mode["async"][0]["snapshot_bytes"]
    summary = data["summary"]
    assert set(summary["step_ratio"]) == {"sync", "async", "async-nice19"}
    assert set(summary["step_ratio"]["async"]) == {"median", "min", "max"}
    assert set(summary["targets"]) == {"async", "async-nice19"}
    assert "stall/save" in result.output and "cost_per_save_within_10%_of_sync" in result.output
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("zerorun-bench-ckpt-")], "checkpoints removed"


def test_bench_ckpt_refuses_unknown_modes_and_a_run_without_its_baseline():
    result = CliRunner().invoke(app, ["bench", "ckpt", "--modes", "none,sync,later"])
    assert result.exit_code == 2 and "--modes: unknown later" in result.output
    result = CliRunner().invoke(app, ["bench", "ckpt", "--modes", "sync,async"])
    assert result.exit_code == 2 and "none missing or repeated" in result.output
