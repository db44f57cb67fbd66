"""`zerorun bench offload` runs on a CPU too (a small model), so its command line, rounds and table are tested here;
its figures come from a GPU machine (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from zerorun.bench import offload
from zerorun.cli import app


@pytest.mark.slow
def test_the_command_runs_zeroruns_modes_and_says_why_deepspeed_is_missing(tmp_path) -> None:
    out = tmp_path / "offload.json"
    systems = "zero2-host,zero2-host-overlap" + (",deepspeed2-offload" if offload.missing("deepspeed2-offload") else "")
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "bench", "offload", "--systems", systems,
                             "--steps", "1", "--rounds", "1", "--json", str(out)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["system"]: row for row in json.loads(out.read_text())["rows"]}
    for system in ("zero2-host", "zero2-host-overlap"):
        assert rows[system]["step_s"] > 0 and rows[system]["params"] > 0
    assert rows["zero2-host"]["final_loss"] == rows["zero2-host-overlap"]["final_loss"]  # bit-identical modes
    if offload.missing("deepspeed2-offload"):
        assert rows["deepspeed2-offload"]["step_s"] is None
        assert "deepspeed does not import here" in rows["deepspeed2-offload"]["note"]
    assert "ZeRO-Offload on one device" in result.stdout


def test_an_unknown_system_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "offload", "--systems", "zero2-hots"])
    assert result.exit_code == 2 and "--systems: unknown zero2-hots" in result.stderr, result.output


def test_without_deepspeed_its_rows_are_missing_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload.importlib.util, "find_spec", lambda name: None)
    assert "deepspeed does not import here" in (offload.missing("deepspeed3-offload") or "")
    assert offload.missing("zero3-host") is None
