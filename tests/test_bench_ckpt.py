"""`zerorun bench ckpt` runs its three modes on a tiny model and reports stalls, writes and ratios.

Plumbing only (which columns, which records): the figures themselves are the benchmark's business."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from zerorun.cli import app


def test_bench_ckpt_runs_none_sync_and_async_and_reports_their_saves(tmp_path):
    out = tmp_path / "ckpt.json"
    result = CliRunner().invoke(app, ["bench", "ckpt", "--layers", "1", "--d-model", "32", "--heads", "2", "--vocab",
                                      "64", "--seq-len", "8", "--steps", "4", "--every", "2", "--dir", str(tmp_path),
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    modes = {m["mode"]: m for m in data["modes"]}
    assert list(modes) == ["none", "sync", "async"]
    assert [len(m["saves"]) for m in modes.values()] == [0, 2, 2]
    assert {s["mode"] for s in modes["async"]["saves"]} == {"async"} and modes["async"]["saves"][0]["snapshot_bytes"]
    assert set(data["summary"]) == {"step_ratio", "async_stall_over_sync_save"}
    assert "stall/save" in result.output and "async_stall_over_sync_save" in result.output
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("zerorun-bench-ckpt-")], "checkpoints removed"


def test_bench_ckpt_refuses_unknown_modes():
    result = CliRunner().invoke(app, ["bench", "ckpt", "--modes", "sync,later"])
    assert result.exit_code == 2 and "--modes: unknown later" in result.output
