"""The post-step publish under the next forward, bit-identically: stages 1/2's all-gather
(`zero.overlap_publish`) and stage 3's prefetch of the first units (`zero.overlap_comm`).

Each case trains twice in the same processes, overlap on and off, and demands *equal* bits: the
same collectives fill the same bytes, only the moment of the wait moves, so any difference at all
means a forward read a unit before its gather landed. An inference pass on the module itself
right after `step()` (no engine call in between) checks that module hooks, not the engine, wait.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

STEPS = 5


class _LandsAtWait:
    """A gather whose values reach the parameters only in `wait()`: reading before the wait reads stale bytes."""

    def __init__(self, handle, full: torch.Tensor, scratch: torch.Tensor) -> None:
        self.handle, self.full, self.scratch = handle, full, scratch

    def wait(self) -> None:
        self.handle.wait()
        self.full.copy_(self.scratch)


def _landing_at_wait(all_gather):
    """Wrap `Collectives.all_gather` so that a forward reading a unit before waiting for it always fails
    the comparison (a real gloo gather usually lands before the forward reads, hiding a missing wait)."""
    def gather(full: torch.Tensor, **kwargs: object) -> _LandsAtWait:
        scratch = full.clone()
        return _LandsAtWait(all_gather(scratch, **kwargs), full, scratch)
    return gather


def _train(rank: int, overrides: list[str], overlap: bool, ckpt_dir: str | None = None) -> dict:
    import zerorun
    from tests.runtime.reference import OPT, batch, make_model, tied_gpt
    from zerorun import config
    from zerorun.runtime.stage3.unit_group import UnitState

    recipe = config.loads("script: t.py\n", "t.yaml", ["zero.bucket_mb=0.0005", *overrides,
                                                        f"zero.overlap_comm={str(overlap).lower()}",
                                                        f"zero.overlap_publish={str(overlap).lower()}"])
    model = tied_gpt(0) if "zero.stage=3" in overrides else make_model(0)
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), **OPT), recipe)
    engine.comm.all_gather = _landing_at_wait(engine.comm.all_gather)
    out = {"losses": [], "evals": [], "outstanding": []}
    micro = 0
    for _ in range(STEPS):
        for _a in range(recipe.train.grad_accum_steps):
            loss = engine(batch(0, rank, micro))
            engine.backward(loss)
            engine.step()
            out["losses"].append(loss.item())
            micro += 1
        engine.memory(), engine.num_parameters()  # what telemetry reads: sizes, so no wait for the publish
        if engine.stage == 3:  # stage 3: the next forward's first unit is on its way
            out["outstanding"].append(sum(g.state is UnitState.GATHERING for g in engine.store.groups))
        else:
            out["outstanding"].append(0 if engine.store.deferred is None else engine.store.deferred.outstanding)
        if ckpt_dir is not None and len(out["outstanding"]) == STEPS:
            engine.save_checkpoint(ckpt_dir, tag="t")  # straight after step(): the publish is still outstanding
        if engine.stage < 3 and len(out["outstanding"]) == STEPS:  # a DDP habit after step(): an EMA
            out.setdefault("read_after_step", []).append([p.detach().clone() for p in model.parameters()])
        with torch.no_grad():  # the module itself, straight after step(): its hooks must wait
            out["evals"].append(model(batch(7, rank, micro)).item())
    state = model.state_dict()  # stages 1/2: its hooks wait for the last publish
    with engine.gathered():  # stage 3: whole parameters
        out["state"] = {k: v.clone() for k, v in (model.state_dict() if engine.stage == 3 else state).items()}
    out["units"] = len(engine.store.units)
    if engine.stage < 3:  # the store's deferred publish: None when it publishes within step()
        out["waits"] = 0 if engine.store.deferred is None else engine.store.deferred.deferred_waits
    else:  # one prefetched unit (prefetch_units=1); its wait is the forward's own
        out["units"], out["waits"] = 1, 1
    return out


def _both(rank: int, world: int, cases: list[list[str]]) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    problems = []
    for overrides in cases:
        on, off = _train(rank, overrides, True), _train(rank, overrides, False)
        name = f"{' '.join(overrides)} world={world} rank={rank}"
        for key in ("losses", "evals"):
            if on[key] != off[key]:
                problems.append(f"{name}: {key} differ: {on[key]} vs {off[key]}")
        for i, (a, b) in enumerate(zip(on.get("read_after_step", []), off.get("read_after_step", []), strict=True)):
            if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
                problems.append(f"{name}: model.parameters() read right after step {i} saw unpublished values")
        for k, v in off["state"].items():
            if not torch.equal(on["state"][k], v):
                problems.append(f"{name}: {k} differs by {(on['state'][k] - v).abs().max().item():.2e}")
        if min(on["outstanding"]) < on["units"] or on["waits"] < on["units"]:
            problems.append(f"{name}: the publish was not deferred to forward hooks: {on['outstanding']} "
                            f"outstanding after step, {on['waits']} hook waits, {on['units']} units")
    return problems


STAGE3 = ["zero.wrap=[Block]", "zero.param_persistence_threshold=30", "zero.prefetch_units=1"]
CASES = [[f"zero.stage={stage}", f"train.grad_accum_steps={accum}", f"precision.dtype={dtype}", *offload]
         for stage, accum, dtype, offload in [
             (1, 1, "fp32", []), (2, 3, "fp32", []), (1, 2, "bf16", []), (2, 1, "bf16", []),
             (2, 2, "fp32", ["zero.offload_optimizer=cpu"]), (1, 1, "bf16", ["zero.offload_optimizer=cpu"]),
             (3, 2, "fp32", STAGE3), (3, 1, "bf16", STAGE3), (3, 1, "fp32", [*STAGE3, "zero.offload_optimizer=cpu"])]]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: CI, not the development tier
def test_overlapped_publish_is_bit_identical_and_deferred(world: int) -> None:
    problems = [p for rank_problems in run_ranks(_both, world, (CASES,)) for p in rank_problems]
    assert not problems, "\n".join(problems)


def _checkpoints(rank: int, world: int, root: str) -> None:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    for overlap in (True, False):
        _train(rank, ["zero.stage=2"], overlap, ckpt_dir=f"{root}/{overlap}")


def test_checkpoint_saved_right_after_step_equals_the_synchronous_one(tmp_path) -> None:
    run_ranks(_checkpoints, 2, (str(tmp_path),))
    on, off = tmp_path / "True" / "t", tmp_path / "False" / "t"
    files = sorted(p.name for p in off.iterdir() if p.suffix == ".safetensors")
    assert files and files == sorted(p.name for p in on.iterdir() if p.suffix == ".safetensors")
    for name in files:
        assert (on / name).read_bytes() == (off / name).read_bytes(), name


@pytest.mark.parametrize("setting, local_world, world, deferred", [
    ("auto", 1, 2, True), ("auto", 2, 4, True), ("auto", 2, 2, False), ("auto", None, 3, False),
    (True, 2, 2, True), (False, 1, 2, False)])
def test_auto_overlaps_the_publish_where_ranks_span_nodes(monkeypatch, setting, local_world, world,
                                                          deferred) -> None:
    from zerorun.runtime.deferred_publish import publish_overlaps

    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # outside a launch: one node
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    assert publish_overlaps(setting, world) is deferred


def _engine_defers(rank: int, world: int, local_world: int) -> bool:
    import os

    import zerorun
    from tests.runtime.reference import make_model
    from zerorun import config

    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)  # as the launcher sets it: ranks on this node
    recipe = config.loads("script: t.py\n", "t.yaml", ["zero.stage=2"])  # overlap_publish: auto by default
    engine = zerorun.initialize(make_model(0), None, recipe)
    return engine.store.deferred is not None


def test_the_default_recipe_defers_the_publish_only_across_nodes() -> None:
    assert run_ranks(_engine_defers, 2, (1,)) == [True, True]  # one rank per node
    assert run_ranks(_engine_defers, 2, (2,)) == [False, False]  # both on one node


class _GatedGather:
    """A pending gather that lands (writes `value` into `param`) only once `gate` is set."""

    def __init__(self, param: torch.Tensor, value: float) -> None:
        import threading
        self.param, self.value = param, value
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.waiting.set()
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        with torch.no_grad():
            self.param.fill_(self.value)
        self.done = True


def test_a_forward_waits_for_a_gather_another_thread_is_already_waiting_for() -> None:
    """The telemetry thread reads the root's parameters (guarded: it waits for the publish) while the
    training thread starts its forward. The forward's hook must not find the unit "taken" and read the
    stale bytes: it waits until the other thread's wait has landed the values. Without the lock, the
    forward returned at once with the previous step's weight (a loss off in the 3rd digit, under load)."""
    import threading
    from types import SimpleNamespace

    from torch import nn

    from zerorun.runtime.deferred_publish import DeferredPublish
    from zerorun.runtime.interop.publish_guard import guard_parameter_reads

    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)  # the previous step's value
    deferred = DeferredPublish(model, [SimpleNamespace(params=[model[0].weight])])  # type: ignore[list-item]
    guard_parameter_reads(model, deferred.wait_all)  # as the engine's interop does
    gather = _GatedGather(model[0].weight, 2.0)  # the step's update, still on the wire
    deferred.start(lambda order: {k: gather for k in order})  # type: ignore[misc]

    telemetry = threading.Thread(target=lambda: list(model.parameters()))
    telemetry.start()
    assert gather.waiting.wait(timeout=30)  # the telemetry thread is inside the wait
    read = []
    training = threading.Thread(target=lambda: read.append(model(torch.ones(1, 1)).detach().item()))
    training.start()
    training.join(timeout=0.5)
    assert training.is_alive(), f"the forward did not wait for the gather in flight (read {read})"
    gather.gate.set()
    training.join(timeout=30)
    telemetry.join(timeout=30)
    assert read == [2.0]  # the landed value
    assert deferred.outstanding == 0


def _torn_down(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import zerorun
    from tests.runtime.reference import OPT, batch, make_model, tied_gpt
    from zerorun import config
    from zerorun.runtime import interop
    from zerorun.runtime.comm.dist import init_distributed
    from zerorun.runtime.stage3.unit_group import UnitState

    init_distributed()
    engines = {}
    for stage, overrides in ((2, ["zero.overlap_publish=true"]), (3, [*STAGE3, "zero.overlap_comm=true"])):
        recipe = config.loads("script: t.py\n", "t.yaml", ["zero.bucket_mb=0.0005", f"zero.stage={stage}", *overrides])
        model = tied_gpt(0) if stage == 3 else make_model(0)
        engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), **OPT), recipe)
        for micro in range(2):
            engine.backward(engine(batch(0, rank, micro)))
            engine.step()
        engines[stage] = engine
    in_flight = lambda: {  # noqa: E731
        2: engines[2].store.deferred.outstanding,
        3: sum(g.state is UnitState.GATHERING for g in engines[3].store.groups)}
    before = in_flight()
    release = interop.hold_for_script()  # what the worker holds while the script runs
    dist.destroy_process_group()  # the script's own, at the end of training (a DDP habit)
    release()
    return {"before": before, "after": in_flight()}


def test_a_scripts_own_destroy_process_group_first_finishes_the_collectives_in_flight() -> None:
    """After the last step a deferred publish (stages 1/2) or a prefetch (stage 3) is on the wire; tearing the
    group down under it aborts a gloo process ("terminate called without an active exception"), now and then.
    The worker's wrapper settles every engine first."""
    for out in run_ranks(_torn_down, 2):
        assert out["before"][2] > 0 and out["before"][3] > 0, out  # there was something in flight to settle
        assert out["after"] == {2: 0, 3: 0}, out
