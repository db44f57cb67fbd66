"""`zero.offload_optimizer_ratio`: a share of the offloaded optimizer state stays on the device (Twin-Flow).

The device's share is updated by the device's kernel, the host's share by the host's, with the same
arithmetic (`kernels/adam.h`), so a split trains to the same bits as the whole state on the host: the
placement of the state is not a path through the maths. On a CPU-only machine the "device" is the host,
so these runs exercise the split's bookkeeping (which units, which transfers, the overlap's commit of the
device share) rather than two kernels; `zerorun bench gpu`'s parity tests run both kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_threads
from tests.runtime.reference import engine_run

CASES = {
    "stage 1, fp16": ["zero.stage=1", "precision.dtype=fp16"],
    "stage 2, bf16, overlapped": ["zero.stage=2", "precision.dtype=bf16", "zero.overlap_optimizer=true"],
    "stage 3, parameters on the host, overlapped": ["zero.stage=3", "zero.offload_param=cpu",
                                                    "zero.overlap_optimizer=true"],
}


def _split(rank: int, world: int) -> dict[str, tuple[bool, bool, float]]:
    """{case: (losses equal, parameters equal, share of the state elements on the device)}."""
    out = {}
    for name, overrides in CASES.items():
        runs = {}
        for ratio in ("1.0", "0.5"):
            run, engine = engine_run(rank, 8, 2, [*overrides, "zero.offload_optimizer=cpu",
                                                  f"zero.offload_optimizer_ratio={ratio}"], clip=3.6,
                                     inject_inf_at=(5,))
            engine.store.settle()
            pieces = [p for group in engine.update.pieces for p in group]
            on_device = sum(p.numel for p in pieces if engine.update.flat.on_device(p)) / sum(p.numel for p in pieces)
            runs[ratio] = run, on_device
        (whole, none), (split, share) = runs["1.0"], runs["0.5"]
        assert none == 0.0
        out[name] = (whole.losses == split.losses,
                     all(torch.equal(whole.params[n], split.params[n]) for n in whole.params), share)
    return out


def test_a_share_of_the_optimizer_on_the_device_trains_bit_for_bit_as_all_of_it_on_the_host() -> None:
    for rank, result in enumerate(run_threads(_split, 2, timeout=600)):
        for name, (losses, params, share) in result.items():
            assert losses and params, f"rank {rank} {name}: losses equal {losses}, parameters equal {params}"
            assert 0.2 < share < 0.8, f"rank {rank} {name}: {share:.0%} of the state on the device, for a ratio of 0.5"


def test_a_ratio_without_a_host_optimizer_is_refused() -> None:
    from zerorun import config
    from zerorun.errors import ZerorunError

    with pytest.raises(ZerorunError, match="zero.offload_optimizer_ratio.*Set zero.offload_optimizer: cpu"):
        config.loads("script: t.py\nzero: {stage: 2, offload_optimizer_ratio: 0.5}\n", "t.yaml")
    with pytest.raises(ZerorunError, match="zero.offload_optimizer_ratio"):
        config.loads("script: t.py\nzero: {stage: 2, offload_optimizer: cpu, offload_optimizer_ratio: 0}\n", "t.yaml")


def test_the_host_keeps_the_first_units_up_to_a_unit_boundary() -> None:
    from zerorun.runtime.offload.placement import host_numel

    assert host_numel(100, [0, 30, 60, 90], 0.5) == 60  # the first boundary at or past half
    assert host_numel(100, [0, 30, 60, 90], 1.0) == 100
    assert host_numel(100, [0], 0.5) == 100  # one unit: it cannot be split
