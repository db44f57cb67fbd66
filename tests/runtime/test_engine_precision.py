"""bf16 and fp16 match a same-precision reference; fp16 overflow skips exactly the poisoned steps."""

from __future__ import annotations

import torch

from tests.harness import run_ranks
from tests.runtime.reference import ddp_reference, engine_run

STEPS = 12
# Measured on 2 and 3 ranks, 12 steps: both sides run identical bf16/fp16 forward and backward and
# differ only in fp32 summation order, so losses are equal to the bit and fp32 master weights
# differ by at most 3e-8. A rounding flip of one low-precision parameter would move losses by
# ~1e-3, so these tolerances catch any real divergence.
TOLERANCE = {"bf16": (1e-5, 1e-6), "fp16": (1e-5, 1e-6)}


def _compare_low_precision(rank: int, world: int) -> list[str]:
    from zerorun.runtime.dist import init_distributed

    init_distributed()
    problems = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        loss_rtol, param_atol = TOLERANCE[name]
        scale = 1024.0 if name == "fp16" else 1.0
        ref = ddp_reference(rank, STEPS, 2, dtype=dtype, loss_scale=scale)
        for stage in (0, 1, 2):
            overrides = [f"zero.stage={stage}", f"precision.dtype={name}", f"precision.initial_loss_scale={scale}"]
            run, _ = engine_run(rank, STEPS, 2, overrides)
            label = f"{name} stage={stage} world={world} rank={rank}"
            losses, ref_losses = torch.tensor(run.losses), torch.tensor(ref.losses)
            worst = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
            if worst > loss_rtol:
                problems.append(f"{label}: losses differ by {worst:.2e} relative (allowed {loss_rtol})")
            for pname, value in ref.params.items():
                diff = (run.params[pname] - value).abs().max().item()
                if diff > param_atol:
                    problems.append(f"{label}: master weight {pname} differs by {diff:.2e} (allowed {param_atol})")
    return problems


def test_bf16_and_fp16_match_same_precision_reference_on_2_and_3_ranks() -> None:
    for world in (2, 3):
        problems = [p for r in run_ranks(_compare_low_precision, world) for p in r]
        assert not problems, "\n".join(problems)


def _overflow(rank: int, world: int, poisoned: tuple[int, ...]) -> dict:
    run, engine = engine_run(rank, 8, 2, ["zero.stage=2", "precision.dtype=fp16",
                                          "precision.initial_loss_scale=1024"], inject_inf_at=poisoned)
    unchanged = [i for i in range(len(run.param_sums) - 1) if run.param_sums[i] == run.param_sums[i + 1]]
    return {"skipped": engine.skipped_steps, "unchanged_steps": unchanged, "scale": engine.loss_scale}


def test_fp16_overflow_on_one_rank_skips_exactly_that_step_on_every_rank() -> None:
    # micro-steps 3 and 10 belong to optimizer steps 1 and 5 (2 micro-steps each); rank 0 only
    results = run_ranks(_overflow, 3, ((3, 10),))
    for r in results:
        assert r["skipped"] == 2, results
        assert r["unchanged_steps"] == [1, 5], results
        assert r["scale"] == 256.0, results  # two backoffs of 0.5 from 1024
