"""`zero.reduce_dtype: bf16` reduces gradients as DDP does with a bf16 all-reduce hook; fp32 stays exact.

The reference is DDP + torch AdamW on the fp32 model with torch's `bf16_compress_hook` arithmetic
(each bucket cast to bf16, divided by the world size, summed in bf16, cast back), gradients
accumulated in fp32 across micro-steps.

Why 2 ranks without accumulation are exact: both sides round each rank's fp32 gradient to bf16 and
round the sum of the two to bf16 once (a sum of two numbers is the same in any order); the hook
divides by 2 before summing, zerorun after, in fp32, and halving is exact in binary floating
point. So the reduced gradients are equal to the bit and the runs differ only as fp32 parity runs
do (test_engine_parity.py's bounds). Measured: losses 1.8e-7 relative apart, weights 1.5e-8; the
fp32 reduction lies 1e-5 (losses) and 1e-3 (weights) from the same reference, which the test
checks so that a bf16 setting that is ignored cannot pass.

With accumulation on 3 ranks the two are different roundings of the same sum: the hook divides by
3 in bf16 (not exact) and accumulates in fp32, zerorun sums undivided and accumulates the
reduced shard in bf16 (DeepSpeed's grad_accum_dtype semantics), so a gradient element differs by
a few bf16 roundings: at most about 4u relative to the sum of its magnitudes (unit roundoff u =
2^-8; 2 rank sums, the division, the accumulation). Adam's step is lr times a ratio of moments,
so such a change moves each weight by at most about lr * 4u per step (weights: STEPS * lr * 4u =
9.4e-4, measured 4.4e-4), and the gradient norm by 4u relative, which a dropped world-size
division (3x) or an unreduced gradient cannot meet. Losses are fp32 here; a weight change that
small moves them far less than u (measured 1.8e-5 relative; bound u).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.reference import OPT, ddp_reference, engine_run

STEPS = 20
U = 2.0**-8  # bf16's unit roundoff
EXACT_LOSS_RTOL, EXACT_PARAM_ATOL = 1e-6, 5e-7  # fp32 parity's bounds (test_engine_parity.py)
STAGE3 = ["zero.wrap=[Linear]"]


def _differences(run, ref) -> tuple[float, float, float]:
    """(worst relative loss difference, worst relative grad-norm difference, worst weight difference)."""
    losses, ref_losses = torch.tensor(run.losses), torch.tensor(ref.losses)
    norms, ref_norms = torch.tensor(run.grad_norms), torch.tensor(ref.grad_norms)
    params = max((run.params[n] - value).abs().max().item() for n, value in ref.params.items())
    return (((losses - ref_losses).abs() / ref_losses.abs()).max().item(),
            ((norms - ref_norms).abs() / ref_norms.abs()).max().item(), params)


def _two_ranks_no_accumulation(rank: int, world: int) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    bf16_ref, fp32_ref = ddp_reference(rank, STEPS, 1, bf16_reduce=True), ddp_reference(rank, STEPS, 1)
    problems = []
    for stage in (0, 1, 2, 3):
        extra = STAGE3 if stage == 3 else []
        bf16, _ = engine_run(rank, STEPS, 1, [f"zero.stage={stage}", "zero.reduce_dtype=bf16", *extra])
        fp32, _ = engine_run(rank, STEPS, 1, [f"zero.stage={stage}", "zero.reduce_dtype=fp32", *extra])
        for name, run, ref in (("bf16", bf16, bf16_ref), ("fp32", fp32, fp32_ref)):
            loss, norm, param = _differences(run, ref)
            if loss > EXACT_LOSS_RTOL or norm > EXACT_LOSS_RTOL or param > EXACT_PARAM_ATOL:
                problems.append(f"stage {stage} {name}: losses {loss:.1e}, norms {norm:.1e}, weights {param:.1e}")
        loss, _, param = _differences(fp32, bf16_ref)
        if param < 100 * EXACT_PARAM_ATOL:  # the comparison tells bf16 reduction from fp32
            problems.append(f"stage {stage}: the fp32 reduction is only {param:.1e} from the bf16 reference")
    return problems


def test_bf16_reduction_on_two_ranks_equals_ddp_with_a_bf16_all_reduce_and_fp32_stays_exact() -> None:
    assert run_ranks(_two_ranks_no_accumulation, 2) == [[], []]


def _three_ranks_accumulating(rank: int, world: int) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    ref = ddp_reference(rank, STEPS, 2, bf16_reduce=True)
    problems = []
    for stage in (2, 3):
        run, _ = engine_run(rank, STEPS, 2, [f"zero.stage={stage}", "zero.reduce_dtype=bf16",
                                             *(STAGE3 if stage == 3 else [])])
        loss, norm, param = _differences(run, ref)
        if loss > U or norm > 4 * U or param > STEPS * OPT["lr"] * 4 * U:
            problems.append(f"stage {stage}: losses {loss:.1e}, norms {norm:.1e}, weights {param:.1e}")
    return problems


@pytest.mark.slow
def test_bf16_reduction_accumulating_on_three_ranks_stays_within_bf16_roundings_of_ddp() -> None:
    assert run_ranks(_three_ranks_accumulating, 3) == [[], [], []]
