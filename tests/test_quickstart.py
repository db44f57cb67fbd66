"""The quick start's recipe trains end to end through the real launcher, engine and relay."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_quickstart_recipe_trains_through_the_launcher() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "zerorun.cli", "launch", str(ROOT / "recipes/quickstart.yaml"),
         "--set", "train.steps=12", "--set", "precision=bf16"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"\[localhost:0\] step +\d+ +loss ([\d.]+)", result.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, result.stdout  # it learns
    assert "[localhost:0] done: 12 steps" in result.stdout
    assert "ZeRO stage 2, bf16" in result.stdout
