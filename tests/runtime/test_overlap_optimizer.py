"""The host optimizer under the backward (`zero.overlap_optimizer`) trains bit for bit as without it.

The overlap updates each unit on the host while the backward goes on, assuming the step is applied
as is; `step()` checks that assumption and rolls back exactly where it fails. So every case here
trains twice on the same ranks, overlap off and on, and asks for equal bits: losses and final
parameters, over 20 steps with accumulation 2. The runs are built so that both outcomes of the check
happen: a clip norm inside the range of the gradient norms (it fires on some steps and not on others)
and a non-finite gradient on one micro-step (that step is skipped, in fp16 the loss scale backs
off). Each run reports how many steps it applied as speculated and how many it rolled back; a case
where either is zero would prove nothing about that path, and fails.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.optimizers import OPTIMIZERS, STAGE3
from tests.runtime.reference import engine_run

STEPS, ACCUM = 20, 2
CLIP = 3.6  # the small model's gradient norms run 3.2-4.0 over 20 steps (stage 2, fp32): this fires on some
INF_AT = (13,)  # a micro-step of the 7th step, on rank 0: that step is skipped everywhere
CASES = {
    "stage 1, fp16": ["zero.stage=1", "precision.dtype=fp16"],
    "stage 2, fp32": ["zero.stage=2"],
    "stage 2, bf16": ["zero.stage=2", "precision.dtype=bf16"],
    "stage 3, fp32, parameters on the device": ["zero.stage=3"],
    "stage 3, bf16, parameters on the host": ["zero.stage=3", "precision.dtype=bf16", "zero.offload_param=cpu"],
}


def _both(rank: int, world: int, cases: dict[str, list[str]]) -> dict[str, tuple[bool, bool, int, int]]:
    """{case: (losses equal, parameters equal, steps applied as speculated, rolled back)}."""
    out = {}
    for name, overrides in cases.items():
        runs = {}
        for mode in ("false", "true"):
            run, engine = engine_run(rank, STEPS, ACCUM, [*overrides, "zero.offload_optimizer=cpu",
                                                          f"zero.overlap_optimizer={mode}"],
                                     clip=CLIP, inject_inf_at=INF_AT)
            engine.store.settle()
            runs[mode] = run, engine.update.overlap
        (off, none), (on, overlap) = runs["false"], runs["true"]
        assert none is None and overlap is not None
        same_params = all(torch.equal(off.params[n], on.params[n]) for n in off.params)
        assert set(overlap.reasons) == {"clipped", "skipped"}, f"{name}: rolled back for {dict(overlap.reasons)}"
        out[name] = (off.losses == on.losses, same_params, overlap.applied, overlap.rollbacks)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_overlap_is_bit_identical_with_clipping_that_fires_and_an_overflow(world: int) -> None:
    problems = []
    for rank, result in enumerate(run_ranks(_both, world, (CASES,), timeout=900)):
        for name, (losses, params, applied, rolled_back) in result.items():
            if not (losses and params):
                problems.append(f"rank {rank} {name}: losses equal {losses}, parameters equal {params}")
            if not (applied and rolled_back):
                problems.append(f"rank {rank} {name}: {applied} steps applied as speculated, {rolled_back} rolled "
                                f"back: both paths must run")
    assert not problems, "\n".join(problems)


def _reads_between_backward_and_step(rank: int, world: int) -> dict[str, bool]:
    """The state as the script sees it between the window's last backward and step(): as before the backward."""
    import zerorun
    from tests.runtime.reference import OPT, batch, make_model
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", ["zero.stage=2", "zero.offload_optimizer=cpu",
                                                       "zero.overlap_optimizer=true"])
    model = make_model(0)
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), **OPT), recipe)
    before = {n: v.clone() for n, v in engine.state_dict().items()}
    engine.backward(engine(batch(0, rank, 0)))
    speculation = engine.update.overlap.settle()
    updated_meanwhile = speculation is not None and bool(speculation.groups_updated)
    after = engine.state_dict()  # rolls the speculation back first
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    engine.backward(engine(batch(0, rank, 1)))
    engine.optimizer.param_groups[0]["lr"] *= 0.5  # changed between the backward and the step
    engine.step()  # the speculation used the old lr: rolled back, and the step runs with the new one
    told = engine.update.stats()  # what telemetry sends (issue 57: the overlap could not be seen working)
    return {"updated under the backward": updated_meanwhile, "state dict unchanged": unchanged,
            "rolled back": engine.update.overlap.rollbacks == 2 and engine.update.overlap.applied == 0,
            "told why": told.get("overlap_rollbacks") == {"read": 1.0, "hyper": 1.0},
            "told how much": told["overlap"]["rolled_back"] == 2 and told["overlap"]["seconds"] > 0}


def test_reads_between_backward_and_step_see_the_state_before_it() -> None:
    for result in run_ranks(_reads_between_backward_and_step, 2):
        assert all(result.values()), result


def test_overlap_without_a_host_optimizer_is_refused() -> None:
    from zerorun import config
    from zerorun.errors import ZerorunError

    with pytest.raises(ZerorunError, match="zero.overlap_optimizer.*not in host memory"):
        config.loads("script: t.py\nzero: {stage: 2, overlap_optimizer: true}\n", "t.yaml")
    assert config.loads("script: t.py\nzero: {stage: 2}\n", "t.yaml").zero.overlap_optimizer == "auto"


# -- the owner way (optim/owner_overlap.py): Muon, Adafactor, LAMB stepped unit by unit under the backward --------------
OWNER_CASES = {  # (tests/runtime/optimizers.py's optimizer, overrides)
    "Muon + AdamW, stage 2, fp32": ("muon+adamw", ["zero.stage=2"]),
    "Muon + AdamW, stage 3, bf16, parameters on the host": (
        "muon+adamw", ["zero.stage=3", "precision.dtype=bf16", "zero.offload_param=cpu", *STAGE3]),
    "Adafactor, stage 3, fp32": ("adafactor", ["zero.stage=3", *STAGE3]),
    "LAMB, stage 1, fp16": ("lamb", ["zero.stage=1", "precision.dtype=fp16"]),
}
OWNER_STEPS = 8
CLIPPED_AT = (2, 5)  # steps whose script calls clip_grad_norm_ with a norm every step exceeds: rolled back


def _owner_run(rank: int, name: str, overrides: list[str], overlap: str) -> tuple[list[float], dict, dict]:
    """(losses, parameters, the overlap's telemetry) of one run with the optimizers `name` makes."""
    import zerorun
    from tests.runtime.reference import batch, make_model
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [
        f"train.grad_accum_steps={ACCUM}", "zero.bucket_mb=0.0005", "zero.allgather_bucket_mb=0.0005",
        "checkpoint.resume=never", "zero.offload_optimizer=cpu", f"zero.overlap_optimizer={overlap}", *overrides])
    model = make_model(0)
    optimizers = OPTIMIZERS[name](model)
    engine = zerorun.initialize(model, optimizers if len(optimizers) > 1 else optimizers[0], recipe)
    losses = []
    for micro in range(OWNER_STEPS * ACCUM):
        loss = engine(batch(0, rank, micro))
        if micro in INF_AT and rank == 0:
            loss = loss * float("inf")
        engine.backward(loss)
        if micro // ACCUM in CLIPPED_AT and micro % ACCUM == ACCUM - 1:
            engine.clip_grad_norm_(list(engine.module.parameters()), 1e-4)
        engine.step()
        losses.append(loss.item())
    with engine.gathered():
        params = {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}
    told = engine.update.stats()
    engine.destroy()
    return losses, params, told


def _owner_both(rank: int, world: int, cases: dict[str, tuple[str, list[str]]]) -> dict[str, tuple[list[str], float]]:
    """{case: (what is wrong on this rank, the owned parameters it stepped under the backward)}."""
    out = {}
    for case, (name, overrides) in cases.items():
        off_losses, off_params, _ = _owner_run(rank, name, overrides, "false")
        on_losses, on_params, told = _owner_run(rank, name, overrides, "true")
        problems = []
        if off_losses != on_losses or any(not torch.equal(off_params[n], on_params[n]) for n in off_params):
            problems.append("not bit-identical to overlap_optimizer: false")
        overlap = told["overlap"]
        if not (overlap["applied"] and overlap["rolled_back"]):
            problems.append(f"both paths must run: {overlap}")
        if set(told.get("overlap_rollbacks", {})) != {"clipped", "skipped"}:
            problems.append(f"rolled back for {told.get('overlap_rollbacks')}")
        out[case] = problems, overlap.get("owned", 0.0)  # a rank may own none of a small model's matrices
    return out


@pytest.mark.slow
def test_the_owner_way_under_the_backward_is_bit_identical_with_clips_and_an_overflow() -> None:
    results = run_ranks(_owner_both, 3, (OWNER_CASES,), timeout=900)
    problems = [f"rank {rank} {case}: {p}" for rank, result in enumerate(results)
                for case, (found, _) in result.items() for p in found]
    problems += [f"{case}: no rank stepped an owned parameter under the backward" for case in OWNER_CASES
                 if not any(result[case][1] for result in results)]
    assert not problems, "\n".join(problems)


class GroupCounter(torch.optim.Optimizer):
    """A script's optimizer that counts its steps in its param groups: stepped unit by unit, it would count each."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.05})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in (p for p in group["params"] if p.grad is not None):
                p.add_(p.grad * p.grad.norm(), alpha=-group["lr"] / group["count"] ** 0.5)


class OwnCounter(torch.optim.Optimizer):
    """... and one that counts them in an attribute of its own."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.05})
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None) -> None:
        self.calls += 1
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                p.add_(p.grad * p.grad.norm(), alpha=-group["lr"] / self.calls ** 0.5)


def _host_engine(stage: int, overlap: str, optimizers: Callable[[torch.nn.Module], Any]) -> Any:
    """An engine over the test model at `stage` with `optimizers(model)`, their state on the host, `overlap` as
    given (tiny buckets: several units per rank)."""
    import zerorun
    from tests.runtime.reference import make_model
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [f"zero.stage={stage}", "zero.bucket_mb=0.0005",
                                                       "zero.offload_optimizer=cpu", f"zero.overlap_optimizer={overlap}"])
    model = make_model(0)
    return zerorun.initialize(model, optimizers(model), recipe)


def _counted(rank: int, world: int, kind: str) -> dict[str, object]:
    from tests.runtime.reference import batch

    cls = GroupCounter if kind == "group" else OwnCounter
    runs = {}
    for overlap in ("false", "true"):
        engine = _host_engine(2, overlap, lambda model: cls([p for p in model.parameters() if p.requires_grad]))
        losses = []
        for micro in range(5):
            loss = engine(batch(0, rank, micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        runs[overlap] = losses, engine.state_dict(), engine.update.stats()
        engine.destroy()
    (off, off_state, _), (on, on_state, told) = runs["false"], runs["true"]
    return {"bits": off == on and all(torch.equal(off_state[n], on_state[n]) for n in off_state),
            "why": told.get("overlap_rollbacks", {})}


@pytest.mark.parametrize("kind", ["group", "own"])
def test_an_optimizer_counting_its_steps_beside_its_parameters_is_stepped_whole_after_one_rollback(kind: str) -> None:
    results = run_ranks(_counted, 2, (kind,))
    assert all(result["bits"] for result in results), results
    # the counter is seen where a rank stepped the optimizer more than once under one backward (a counter in a group:
    # at its first call); then that optimizer steps once, after the backward, and nothing more is rolled back for it
    assert any(result["why"].get("whole") == 1 for result in results), results
    assert all(result["why"].get("whole", 0) <= 1 for result in results), results


def _owned_reads(rank: int, world: int) -> dict[str, bool]:
    """Muon's owned steps made under the backward, seen from the script between the backward and step()."""
    from tests.runtime.reference import batch

    runs = {}
    for overlap in ("false", "true"):
        engine = _host_engine(3, overlap, OPTIMIZERS["muon+adamw"])
        muon = next(g for g in engine.optimizer.param_groups if "ns_steps" in g)
        before = {n: v.clone() for n, v in engine.state_dict().items()}
        engine.backward(engine(batch(0, rank, 0)))
        after = engine.state_dict()  # rolls the owned steps back first
        unchanged = all(torch.equal(before[n], after[n]) for n in before)
        engine.step()  # the backward's gradients, stepped after it
        engine.backward(engine(batch(0, rank, 1)))
        if engine.update.overlap is not None:  # the owned steps are made (else some may see the new lr: no rollback)
            engine.update.overlap.settle()
        muon["lr"] *= 0.5  # changed between the backward and the step: the owned steps used the old lr
        engine.step()
        runs[overlap] = engine.state_dict(), unchanged, engine.update.stats()
        engine.destroy()
    (off, _, _), (on, unchanged, told) = runs["false"], runs["true"]
    return {"bits": all(torch.equal(off[n], on[n]) for n in off), "unchanged": unchanged,
            "why": told.get("overlap_rollbacks") == {"read": 1.0, "hyper": 1.0}}


def test_owned_steps_under_the_backward_roll_back_for_a_read_and_for_a_learning_rate_changed_before_step() -> None:
    for result in run_ranks(_owned_reads, 2):
        assert all(result.values()), result


def _owned_on_a_standin_gpu(rank: int, world: int) -> dict[str, object]:
    """Muon + AdamW at stage 2 with the state on the host: on the CPU, then on a stood-in GPU where `auto` overlaps
    (tests/runtime/cuda_standin.py: the owned state comes from pinned host buffers for each unit's step, on the
    overlap's worker, and goes back)."""
    from tests.runtime.cuda_standin import pretend_cuda

    name, overrides = OWNER_CASES["Muon + AdamW, stage 2, fp32"]
    cpu_losses, cpu_params, _ = _owner_run(rank, name, overrides, "false")  # starts the process group
    with pretend_cuda("gloo"):
        gpu_losses, gpu_params, told = _owner_run(rank, name, overrides, "auto")
    return {"bits": cpu_losses == gpu_losses and all(torch.equal(cpu_params[n], gpu_params[n]) for n in cpu_params),
            "overlapped": "overlap" in told, "owned": told.get("overlap", {}).get("owned", 0.0)}


def test_auto_steps_the_owned_parameters_under_the_backward_beside_a_gpu_exactly() -> None:
    results = run_ranks(_owned_on_a_standin_gpu, 2)
    assert all(result["bits"] and result["overlapped"] for result in results), results
    assert any(result["owned"] for result in results), results
