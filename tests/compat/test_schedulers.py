"""DeepSpeed's LR schedules: its formulas and stepping, checked by hand and against DeepSpeed when present."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from zerorun import config
from zerorun.runtime.optim import schedules as schedulers

CASES = {  # DeepSpeed's constructor arguments (its names) per schedule
    "WarmupLR": dict(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10),
    "WarmupDecayLR": dict(total_num_steps=30, warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10,
                          warmup_type="linear"),
    "WarmupCosineLR": dict(total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=5, cos_min_ratio=0.01),
    "OneCycle": dict(cycle_min_lr=0.001, cycle_max_lr=0.01, decay_lr_rate=0.5, cycle_first_step_size=6,
                     cycle_first_stair_count=3,
                     cycle_second_step_size=4, decay_step_size=3, cycle_min_mom=0.85, cycle_max_mom=0.95,
                     decay_mom_rate=0.1),
    "LRRangeTest": dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=4, lr_range_test_step_rate=2.0,
                        lr_range_test_staircase=True),
}
ITERATIONS = 32


def _trace(kind: str) -> list[list[float]]:
    """[lr, beta1] after construction and after each of ITERATIONS steps, with zerorun's schedules."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.02)
    schedule = getattr(schedulers, kind)(opt, **CASES[kind])
    out = []
    for _ in range(ITERATIONS + 1):
        out.append([opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]])
        schedule.step()
    return out


def test_warmup_lr_rises_as_log_from_the_minimum_and_then_stays() -> None:
    lrs = [lr for lr, _ in _trace("WarmupLR")]
    assert lrs[0] == lrs[1] == 0.001  # built: iteration -1; first step: iteration 0 (log 1 = 0)
    assert lrs[2] == pytest.approx(0.001 + 0.009 * math.log(2) / math.log(10))
    assert lrs[11:] == pytest.approx([0.01] * (ITERATIONS - 10), rel=1e-12)


def test_warmup_decay_and_cosine_end_where_deepspeed_says() -> None:
    decay = [lr for lr, _ in _trace("WarmupDecayLR")]
    assert decay[11] == pytest.approx(0.01) and decay[31] == 0.0  # iteration 30 = total: 0
    cosine = [lr for lr, _ in _trace("WarmupCosineLR")]
    assert cosine[0] == 0.0 and cosine[1] == pytest.approx(0.002)  # warmup_min_ratio x the optimizer's lr
    assert cosine[30] == pytest.approx(0.02 * 0.01)  # at total_num_steps: cos_min_ratio


def test_one_cycle_cycles_lr_up_and_beta1_down_then_decays() -> None:
    trace = _trace("OneCycle")
    assert trace[0] == [0.001, 0.85]
    peak = trace[6]  # iteration 5: scale 1 at the end of the first half (6 steps)
    assert peak[0] == pytest.approx(0.01) and peak[1] == pytest.approx(0.85)
    assert trace[11][0] == pytest.approx(0.001 / (1 + 0.5 * 1 / 3))  # first decay interval


@pytest.mark.parametrize("kind", sorted(CASES))
def test_build_from_a_recipe_matches_direct_construction(kind: str) -> None:
    params = {k: v for k, v in CASES[kind].items()}
    recipe = config.from_dict({"script": "t.py", "scheduler": {"type": kind, **params}})
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.02)
    schedule = schedulers.build(recipe.scheduler, opt, default_total=100)
    lrs = []
    for _ in range(ITERATIONS + 1):
        lrs.append(opt.param_groups[0]["lr"])
        schedule.step()
    assert lrs == [lr for lr, _ in _trace(kind)]


DEEPSPEED_TRACE = """
import json, sys, torch
from deepspeed.runtime import lr_schedules
cases, n = json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for kind, kwargs in cases.items():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.02)
    s = getattr(lr_schedules, kind)(opt, **kwargs)
    trace = []
    for _ in range(n + 1):
        trace.append([opt.param_groups[0]["lr"], opt.param_groups[0]["betas"][0]])
        s.step()
    out[kind] = trace
print(json.dumps(out))
"""


def test_every_schedule_equals_deepspeeds_own() -> None:
    python = os.environ.get("ZERORUN_DEEPSPEED_PYTHON", sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["DS_ACCELERATOR"] = "cpu"
    result = subprocess.run([python, "-c", DEEPSPEED_TRACE, json.dumps(CASES), str(ITERATIONS)], capture_output=True,
                            text=True, env=env, timeout=300)
    if result.returncode != 0 and "No module named 'deepspeed'" in result.stderr:
        pytest.skip(f"DeepSpeed is not importable by {python} (set ZERORUN_DEEPSPEED_PYTHON)")
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    for kind in CASES:
        ours = [v for pair in _trace(kind) for v in pair]
        assert ours == pytest.approx([v for pair in theirs[kind] for v in pair], rel=1e-12, abs=1e-15), kind
