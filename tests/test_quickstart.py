"""The quick start's recipe trains end to end through the real launcher, engine and relay."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_one_gpu_offload_recipe_and_its_profiler_run_scaled_down_on_a_cpu() -> None:
    """recipes/offload_one_gpu.yaml and zerorun.bench.offload_profile are measured on a GPU (docs/gpu.md);
    here a tiny GPT goes through the same settings (bf16, CPU optimizer, stages 2 and 3)."""
    tiny = 'args=[--layers,"2",--d-model,"32",--heads,"2",--vocab,"128",--seq-len,"16",--log-every,"1"]'
    result = subprocess.run(
        [sys.executable, "-m", "zerorun.cli", "launch", str(ROOT / "recipes/offload_one_gpu.yaml"), "--set", tiny,
         "--set", "train.micro_batch_size=2", "--set", "zero.stage=3", "--set", "zero.offload_param=cpu"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ZeRO stage 3 (2 units), bf16" in result.stdout and "[localhost:0] done: 4 steps" in result.stdout
    profile = subprocess.run(
        [sys.executable, "-m", "zerorun.bench.offload_profile", "--layers", "2", "--d-model", "32", "--heads", "2",
         "--seq-len", "16", "--micro-batch", "2", "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert profile.returncode == 0, profile.stdout + profile.stderr
    assert re.search(r"ZeRO stage 2: forward [\d.]+ s \+ backward [\d.]+ s .* = [\d.]+ s a step", profile.stdout)
    assert re.search(r"offload, all steps: D2H [\d.]+ GiB in [\d.]+ s, H2D", profile.stdout), profile.stdout
