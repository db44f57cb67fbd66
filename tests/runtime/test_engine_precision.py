"""bf16 and fp16 train like a same-precision reference at every stage (0-3), the comparison catches a
wrong gradient scale or a skipped step, and fp16 overflow skips exactly the poisoned steps.

Why the tolerances are what they are (issue 14: this test failed on an AMD EPYC host)
-------------------------------------------------------------------------------------
The engine and the reference run the same low-precision forward and backward from the same
weights; they differ only in the last bit of some fp32 results: the order in which gradients are
summed (3 ranks), and the Adam arithmetic. torch's CPU fused AdamW, whose arithmetic zerorun's
kernel implements, rounds the elements of its vectorised body and of its scalar tail differently,
so an element's result depends on where its tensor is cut (per parameter in the reference, per
flat shard piece in the engine); torch's default for-loop AdamW, which the reference used
before, differs from it in many more elements. In fp32 such a bit stays a bit. But the weights
the forward uses are the fp32 master rounded to bf16/fp16: when a master weight lies within that
bit of a rounding midpoint, the two runs round it differently, and from then on they are two
equally correct low-precision runs whose weights differ by a whole ulp of the compute format
(2u relative; unit roundoff u = 2^-8 for bf16, 2^-11 for fp16). Whether and when that happens
depends on the bits of the trajectory, so on the host: the old bound (1e-6) held where it was
written and failed here, fp16, one weight rounded the other way at step 3, its gradients
changed at step 4, and Adam carried the change to 2.92e-6 by step 12. Measured here (fp16, 2
ranks, stage 0, seeds 0-7): with the for-loop AdamW reference 2 of 8 seeds end 1.5e-6 and
2.9e-6 apart, the others <= 1.2e-7; with the fused AdamW reference all 8 end <= 7.5e-9 apart.
Fewer flips is not none, so the bounds are those of two runs that differ by roundings of the
compute format, for STEPS steps at learning rate lr:

- losses, rtol u: a loss computed from logits in the compute format is defined only to u.
- gradient norms, rtol u: a weight rounded differently moves gradients by about u relative. A
  wrong gradient scale (a dropped world-size division: 2x; a missed unscale: 1024x) shows only
  here, because Adam's step does not depend on the gradient's scale.
- master weights, atol STEPS * lr * u: Adam's step is lr times a ratio of moments, so a
  relative change u of the gradients changes each step by at most about lr * u.
  (fp16: 1.8e-5, 6x the worst flip measured; bf16: 1.4e-4.) A skipped step moves weights by up
  to lr = 3e-3, a dropped weight decay by lr * 0.1 * |w| per step.

`test_the_bounds_catch_a_dropped_world_division_a_missed_unscale_and_a_skipped_step` checks that
these bounds still fail on each of those mistakes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.harness import run_threads
from tests.runtime.reference import MISTAKES, OPT, Run, ddp_reference, engine_run

STEPS = 12
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_SCALE = {"bf16": 1.0, "fp16": 1024.0}
# stage 3 with every kind of unit: up/down wrapped, the tied embedding/head in the root unit,
# the LayerNorm's 13-element parameters persistent
STAGE3 = ["zero.wrap=[Linear]", "zero.param_persistence_threshold=20"]


@dataclass(frozen=True)
class Bounds:
    loss_rtol: float
    norm_rtol: float
    param_atol: float

    @classmethod
    def of(cls, name: str) -> Bounds:
        u = UNIT_ROUNDOFF[name]
        return cls(loss_rtol=u, norm_rtol=u, param_atol=STEPS * OPT["lr"] * u)


def _overrides(name: str, stage: int) -> list[str]:
    return [f"zero.stage={stage}", f"precision.dtype={name}", f"precision.initial_loss_scale={LOSS_SCALE[name]}",
            *(STAGE3 if stage == 3 else [])]


def _engine(rank: int, name: str, stage: int) -> tuple[Run, dict[str, torch.Tensor]]:
    """The engine's run and its fp32 master weights (stage 3: on rank 0 only, {} elsewhere)."""
    run, engine = engine_run(rank, STEPS, 2, _overrides(name, stage))
    if engine.stage < 3:
        return run, run.params  # stages 0-2: engine_run all-gathers the master
    state = engine.state_dict()  # stage 3: the master, consolidated on rank 0
    return run, {n: state[n].float() for n in run.params} if state else {}


def _problems(label: str, run: Run, masters: dict[str, torch.Tensor], ref: Run, bounds: Bounds) -> list[str]:
    problems = []
    for what, ours, theirs, rtol in (("losses", run.losses, ref.losses, bounds.loss_rtol),
                                     ("gradient norms", run.grad_norms, ref.grad_norms, bounds.norm_rtol)):
        ours_t, theirs_t = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
        worst = ((ours_t - theirs_t).abs() / theirs_t.abs()).max().item()
        if not worst <= rtol:  # also catches nan
            problems.append(f"{label}: {what} differ by {worst:.2e} relative (allowed {rtol:.2e})")
    for pname, value in ref.params.items() if masters else ():
        diff = (masters[pname] - value).abs().max().item()
        if not diff <= bounds.param_atol:
            problems.append(f"{label}: master weight {pname} differs by {diff:.2e} (allowed {bounds.param_atol:.2e})")
    return problems


def _compare_low_precision(rank: int, world: int) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    problems = []
    for name in ("bf16", "fp16"):
        ref = ddp_reference(rank, STEPS, 2, dtype=DTYPES[name], loss_scale=LOSS_SCALE[name])
        for stage in (0, 1, 2, 3):
            run, masters = _engine(rank, name, stage)
            problems += _problems(f"{name} stage={stage} world={world} rank={rank}", run, masters, ref, Bounds.of(name))
    return problems


@pytest.mark.slow
def test_bf16_and_fp16_match_same_precision_reference_at_every_stage_on_2_and_3_ranks() -> None:
    for world in (2, 3):  # 2 references and 8 engine runs per rank: a limit with room for a loaded host
        problems = [p for r in run_threads(_compare_low_precision, world, timeout=900) for p in r]
        assert not problems, "\n".join(problems)


def _compare_with_mistakes(rank: int, world: int) -> dict[str, list[str]]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    run, masters = _engine(rank, "fp16", 2)
    found = {}
    for mistake in (None, *MISTAKES):
        ref = ddp_reference(rank, STEPS, 2, dtype=torch.float16, loss_scale=LOSS_SCALE["fp16"], mistake=mistake)
        found[str(mistake)] = _problems(f"reference with {mistake}", run, masters, ref, Bounds.of("fp16"))
    return found


@pytest.mark.slow
def test_the_bounds_catch_a_dropped_world_division_a_missed_unscale_and_a_skipped_step() -> None:
    # The comparison is symmetric, so a reference with the mistake stands for an engine with it.
    found = run_threads(_compare_with_mistakes, 2, timeout=600)[0]
    assert found.pop("None") == [], "the correct reference must pass"
    for mistake, problems in found.items():
        assert problems, f"a reference with {mistake} passed the fp16 bounds: they are too loose"
    for mistake in ("no-world-division", "no-unscale"):  # Adam hides a wrong scale from losses and weights
        assert any("gradient norms" in p for p in found[mistake]), found
    assert any("master weight" in p for p in found["skip-step-5"]), found


def _overflow(rank: int, world: int, poisoned: tuple[int, ...]) -> dict:
    run, engine = engine_run(rank, 8, 2, ["zero.stage=2", "precision.dtype=fp16",
                                          "precision.initial_loss_scale=1024"], inject_inf_at=poisoned)
    unchanged = [i for i in range(len(run.param_sums) - 1) if run.param_sums[i] == run.param_sums[i + 1]]
    return {"skipped": engine.skipped_steps, "unchanged_steps": unchanged, "scale": engine.loss_scale}


def test_fp16_overflow_on_one_rank_skips_exactly_that_step_on_every_rank() -> None:
    # micro-steps 3 and 10 belong to optimizer steps 1 and 5 (2 micro-steps each); rank 0 only
    results = run_threads(_overflow, 3, ((3, 10),))
    for r in results:
        assert r["skipped"] == 2, results
        assert r["unchanged_steps"] == [1, 5], results
        assert r["scale"] == 256.0, results  # two backoffs of 0.5 from 1024


def _state_dicts(rank: int, world: int) -> dict[int, dict[str, tuple[str, float]]]:
    """engine.state_dict() after 2 bf16 steps at each stage: every tensor's dtype and sum."""
    from tests.runtime.reference import engine_run
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    out = {}
    for stage in (0, 1, 2, 3):
        extra = ["zero.wrap=[]"] if stage == 3 else []
        _, engine = engine_run(rank, 2, 1, [f"zero.stage={stage}", "precision=bf16", *extra])
        state = engine.state_dict()
        out[stage] = {k: (str(v.dtype), float(v.double().sum())) for k, v in state.items()}
        engine.destroy()
    return out


@pytest.mark.slow
def test_state_dict_holds_fp32_master_weights_at_every_stage() -> None:
    """In bf16, engine.state_dict() returned the bf16 compute copies at stages 0-2 and the fp32 master at stage 3;
    now every stage returns the fp32 master, the same values on the same training."""
    by_stage = run_threads(_state_dicts, 2)[0]
    assert by_stage[3]["embed.weight"][0] == "torch.float32" and by_stage[3]["frozen"][0] == "torch.bfloat16"
    for stage, state in by_stage.items():  # frozen parameters and buffers stay as the module holds them
        assert {k: dtype for k, (dtype, _) in state.items()} == {k: d for k, (d, _) in by_stage[3].items()}, stage
        assert state == by_stage[3] or all(abs(state[k][1] - by_stage[3][k][1]) <= 1e-5 * max(1, abs(by_stage[3][k][1]))
                                           for k in state), stage
