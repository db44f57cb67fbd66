"""Optimizer (and stage 3 parameter) offload trains exactly like the same stage without offload.

The offloaded step runs the same Adam kernel on the same fp32 values, only tile by tile on the
host with gradients and updates copied through staging slots, so the results must be *equal* to
the in-memory run, bit for bit — and therefore as close to DDP + torch AdamW as the parity tests
require of every stage. Tiles are made tiny (`buffer_mb`) so every piece is cut into many tiles
and the staging ring wraps around many times.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.reference import ddp_reference, engine_run
from zerorun.runtime.offload.homes import NvmeHome
from zerorun.runtime.offload.placement import Place

STEPS = 12
ACCUM = 2
TINY_TILES = "zero.offload_optimizer.buffer_mb=0.002"  # 524 elements: many tiles per piece
PARAM_ATOL = 5e-7  # as tests/runtime/test_engine_parity.py


def _offload_equals_in_memory(rank: int, world: int, cases: list[tuple[list[str], list[str]]]) -> list[str]:
    import torch.distributed as dist

    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    problems = []
    ref = ddp_reference(rank, STEPS, ACCUM)
    for base, offload in cases:
        plain, _ = engine_run(rank, STEPS, ACCUM, base)
        run, engine = engine_run(rank, STEPS, ACCUM, base + offload)
        name = f"{' '.join(base + offload)} world={world} rank={rank}"
        assert engine.placement.optimizer is not Place.DEVICE and engine.update.stats()["d2h"]["bytes"] > 0, name
        if any("device=nvme" in o for o in offload):
            assert isinstance(engine.store.home, NvmeHome), name
            assert engine.update.stats()["nvme_write"]["bytes"] > 0, name
        if run.losses != plain.losses:
            problems.append(f"{name}: losses differ from the in-memory run: {run.losses[:4]} vs {plain.losses[:4]}")
        for pname, value in plain.params.items():
            if not torch.equal(run.params[pname], value):
                problems.append(f"{name}: {pname} differs from the in-memory run by "
                                f"{(run.params[pname] - value).abs().max().item():.2e}")
        if "precision.dtype=bf16" not in base:
            for pname, value in ref.params.items():
                diff = (run.params[pname] - value).abs().max().item()
                if diff > PARAM_ATOL:
                    problems.append(f"{name}: {pname} differs from DDP by {diff:.2e}")
        dist.barrier()
    return problems


CPU = ["zero.offload_optimizer.device=cpu", TINY_TILES]
CASES = [
    (["zero.stage=1"], CPU),
    (["zero.stage=2"], CPU),
    (["zero.stage=2", "precision.dtype=bf16"], CPU),
    (["zero.stage=3"], CPU),
    (["zero.stage=3"], CPU + ["zero.offload_param.device=cpu"]),
    (["zero.stage=3", "precision.dtype=bf16"], CPU + ["zero.offload_param.device=cpu"]),
]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: CI, not the development tier
def test_cpu_offload_equals_the_same_stage_in_memory_and_ddp(world: int) -> None:
    problems = [p for rank_problems in run_ranks(_offload_equals_in_memory, world, (CASES,)) for p in rank_problems]
    assert not problems, "\n".join(problems)


def _nvme_cases(path: str) -> list[tuple[list[str], list[str]]]:
    nvme = ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={path}", TINY_TILES]
    param = ["zero.offload_param.device=nvme", f"zero.offload_param.nvme_path={path}"]
    return [(["zero.stage=2"], nvme),
            (["zero.stage=2", "precision.dtype=bf16"], nvme),
            (["zero.stage=3"], nvme + param),
            (["zero.stage=3", "precision.dtype=bf16"], nvme + param)]


@pytest.mark.slow
def test_nvme_offload_of_optimizer_and_params_equals_the_same_stage_in_memory(direct_io_dir) -> None:
    cases = _nvme_cases(str(direct_io_dir))
    problems = [p for rank_problems in run_ranks(_offload_equals_in_memory, 3, (cases,)) for p in rank_problems]
    assert not problems, "\n".join(problems)
