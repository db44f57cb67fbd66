"""A DeepSpeed-style script runs unchanged under `zerorun launch` and trains as plain torch does.

`scripts/ds_train.py` is written against DeepSpeed's API (argparse + add_config_arguments,
initialize with a config holding WarmupLR, ZeRO stage 2, accumulation, gradient clipping,
save/load_checkpoint with client_state). It is launched exactly as with DeepSpeed's launcher:
`zerorun launch --num_gpus 2 ds_train.py --deepspeed --deepspeed_config configs/train_fp32.json`,
where the config's train_batch_size 12 with micro-batch 3 on 2 workers means accumulation 2.

The reference is plain torch on the same 2 ranks: DDP + torch.optim.AdamW (fp32), or zerorun's
bf16 policy written out by hand (bf16 compute, fp32 gradient sums and master weights), with the
learning rate of DeepSpeed's WarmupLR computed here from its documented formula.

When DeepSpeed itself is importable (ZERORUN_DEEPSPEED_PYTHON names an interpreter that has it,
default: this one), the same script also runs under real DeepSpeed (DS_ACCELERATOR=cpu, torchrun)
and the losses are compared.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.compat.real_deepspeed import deepspeed_python
from tests.harness import run_ranks
from tests.launch.launched import subprocess_env
from tests.runtime.reference import batch, make_model

HERE = Path(__file__).parent
SCRIPT = HERE / "scripts" / "ds_train.py"
CONFIGS = HERE / "configs"
STEPS, SAVE_AT, WORLD, MICRO, ACCUM = 8, 4, 2, 3, 2
# As tests/runtime/test_engine_parity.py and test_engine_precision.py: the engine and the reference
# differ only in fp32 summation order (measured here: <= 2e-7 relative in fp32, equal to the bit in
# bf16 on most micro-steps); 1e-5 catches any real divergence: the schedule one step early moves
# the losses by 2e-3 relative, a constant lr by 8e-3 (measured with _reference on one rank).
LOSS_RTOL = {"fp32": 1e-5, "bf16": 1e-5}
# Real DeepSpeed, measured (DeepSpeed 0.19.8, CPU, this script): fp32 losses within 1.3e-7
# relative; bf16 within 3.7e-4, because DeepSpeed accumulates and reduces bf16 gradients in bf16
# while zerorun (and the reference) do so in fp32. Before the first update they are identical.
DEEPSPEED_RTOL = {"fp32": 1e-5, "bf16": 2e-3}


def warmup_lr(iteration: int) -> float:
    """DeepSpeed's WarmupLR, linear, as its documentation gives it, for train_*.json's parameters."""
    low, high, steps = 1e-4, 3e-3, 5
    if iteration < 0:
        return low
    return low + (high - low) * (iteration / steps if iteration < steps else 1.0)


def _launch(cwd: Path, dtype: str, out: str, *extra: str) -> None:
    argv = [sys.executable, "-m", "zerorun.cli", "launch", "--num_gpus", str(WORLD), str(SCRIPT), "--deepspeed",
            "--deepspeed_config", str(CONFIGS / f"train_{dtype}.json"), "--steps", str(STEPS), "--out", out, *extra]
    result = subprocess.run(argv, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def _records(prefix: Path) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def zerorun_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """fp32 with a checkpoint after step 4, its resumption from there, and bf16: each on 2 CPU workers."""
    cwd = tmp_path_factory.mktemp("ds_script")
    ckpt = str(cwd / "ckpt")
    _launch(cwd, "fp32", "fp32", "--ckpt", ckpt, "--save_at", str(SAVE_AT))
    _launch(cwd, "fp32", "resumed", "--ckpt", ckpt, "--resume")
    _launch(cwd, "bf16", "bf16")
    return {name: _records(cwd / name) for name in ("fp32", "resumed", "bf16")}


def _reference(rank: int, world: int, dtype_name: str) -> list[float]:
    """DDP + torch AdamW (fp32) or zerorun's bf16 policy by hand; the lr of DeepSpeed's WarmupLR."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    master = make_model(0, plain=True)
    compute = copy.deepcopy(master).to(dtype)
    model = DDP(compute) if dtype == torch.float32 else compute
    opt = torch.optim.AdamW(master.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        for group in opt.param_groups:  # the engine steps the schedule after each update: lr of iteration k-1
            group["lr"] = warmup_lr(step - 1)
        for m in master.parameters():
            m.grad = torch.zeros_like(m)
        for micro in range(ACCUM):
            loss = model(batch(0, rank, step * ACCUM + micro, MICRO))
            (loss / ACCUM).backward()
            for m, c in zip(master.parameters(), compute.parameters()):
                m.grad += c.grad.float()
                c.grad = None
            losses.append(loss.item())
        if dtype != torch.float32:
            for m in master.parameters():
                dist.all_reduce(m.grad)
                m.grad /= world
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)  # the config's gradient_clipping
        opt.step()
        with torch.no_grad():
            for m, c in zip(master.parameters(), compute.parameters()):
                c.copy_(m)
    return losses


def _assert_close(losses: list[float], expected: list[float], rtol: float, what: str) -> None:
    got, want = torch.tensor(losses), torch.tensor(expected)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    worst = ((got - want).abs() / want.abs()).max().item()
    assert worst <= rtol, f"{what}: losses differ by {worst:.2e} relative (allowed {rtol})"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepspeed_script_under_zerorun_launch_matches_plain_torch(zerorun_runs: dict, dtype: str) -> None:
    references = run_ranks(_reference, WORLD, (dtype,))
    for rank, (record, expected) in enumerate(zip(zerorun_runs[dtype], references)):
        _assert_close(record["losses"], expected, LOSS_RTOL[dtype], f"{dtype} rank {rank}")
        assert record["lrs"] == pytest.approx([warmup_lr(step - 1) for step in range(STEPS)], rel=1e-12)
        assert record["global_steps"] == list(range(1, STEPS + 1))
        assert record["local_rank"] == rank  # the --local_rank DeepSpeed's launcher passes


@pytest.mark.slow
def test_resumed_deepspeed_script_continues_exactly_with_its_client_state(zerorun_runs: dict) -> None:
    for full, resumed in zip(zerorun_runs["fp32"], zerorun_runs["resumed"]):
        assert resumed["start"] == SAVE_AT
        assert resumed["client_state"] == {"step": SAVE_AT, "note": "from ds_train"}
        assert resumed["losses"] == full["losses"][SAVE_AT * ACCUM:]  # bit for bit
        assert resumed["lrs"] == full["lrs"][SAVE_AT:]  # the schedule came back with the checkpoint
        assert resumed["global_steps"] == full["global_steps"][SAVE_AT:]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepspeed_script_matches_real_deepspeed(zerorun_runs: dict, dtype: str, tmp_path: Path) -> None:
    python = deepspeed_python()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # DeepSpeed's own, not zerorun's shim
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), str(SCRIPT), "--deepspeed",
            "--deepspeed_config", str(CONFIGS / f"train_{dtype}.json"), "--steps", str(STEPS),
            "--out", str(tmp_path / "ds")]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for rank, (ours, theirs) in enumerate(zip(zerorun_runs[dtype], _records(tmp_path / "ds"))):
        assert ours["losses"][:ACCUM] == theirs["losses"][:ACCUM]  # before the first update: the same model
        _assert_close(ours["losses"], theirs["losses"], DEEPSPEED_RTOL[dtype], f"{dtype} vs DeepSpeed rank {rank}")
        assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12)
        assert math.isclose(ours["lrs"][-1], 3e-3)
