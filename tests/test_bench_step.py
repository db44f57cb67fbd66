"""`zerorun bench step --baseline`: the second ratio column's plumbing (no timings: the runs are faked)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from zerorun.bench import step
from zerorun.cli import app

SECONDS = {"ddp": 2.0, "ddp-fused": 1.0, "zero1": 0.9}  # a fake step time per system


def _fake_run_ranks(fn, world, args, timeout, threads):
    system = args[0]
    return [step.Sample([SECONDS[system]], [0.1], [0.2], [0.3], 100.0, 10.0, 1.5)]


def test_baseline_ratios_are_taken_against_the_chosen_system(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step, "run_ranks", _fake_run_ranks)
    out = tmp_path / "step.json"
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,ddp-fused,zero1", "--baseline", "ddp-fused",
                                      "--rounds", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "x ddp-fused" in result.output and "x DDP" in result.output
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["zero1"]["ratio_to_ddp"] == 0.45 and rows["zero1"]["ratio_to_baseline"] == 0.9
    assert rows["ddp-fused"]["ratio_to_baseline"] == 1.0 and rows["ddp"]["ratio_to_baseline"] == 2.0


def test_default_baseline_is_ddp_and_adds_no_column(monkeypatch) -> None:
    monkeypatch.setattr(step, "run_ranks", _fake_run_ranks)
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,zero1", "--rounds", "1"])
    assert result.exit_code == 0, result.output
    assert "x DDP" in result.output and "x ddp" not in result.output


def test_a_baseline_outside_the_systems_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,zero1", "--baseline", "ddp-fused"])
    assert result.exit_code != 0
    assert "--baseline" in result.output and "not among --systems" in result.output
