"""Stage 3's plan and unit state machine: who goes where, strict transitions that refuse wrong orders,
and the forgiving helpers that accept every legitimate state; both stores implement `ParamStore`."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.reference import tied_gpt
from zerorun.runtime.module_units import UnitKind, UnitState, plan_stage3


def _plan(threshold: int, world: int = 2):
    model = tied_gpt(0)
    groups = [[p for p in model.parameters() if p.requires_grad]]
    return model, plan_stage3(model, groups, ["Block"], threshold, auto_numel=10**9, chunk_numel=500, world=world,
                              dtype=torch.float32)


def test_the_plan_puts_blocks_in_units_shared_weights_in_the_root_and_small_ones_in_the_persistent_set() -> None:
    model, plan = _plan(threshold=30)
    assert [mu.name for mu in plan.gathered_units()] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [mu.kind for mu in plan.module_units[-2:]] == [UnitKind.ROOT, UnitKind.PERSISTENT]
    params_of = lambda mu: {p for k in mu.units for p in plan.units[k].params}  # noqa: E731
    assert model.tok.weight in params_of(plan.root)  # tied to the head: shared, so the root's
    assert all(p.numel() < 30 for p in params_of(plan.persistent)) and params_of(plan.persistent)
    assert all(plan.units[k].layout.numel <= 500 or len(plan.units[k].params) == 1 for k in range(len(plan.units)))
    assert [plan.owner[k] for k in plan.module_units[0].units] == [plan.module_units[0]] * len(plan.module_units[0].units)
    everything = [p for u in plan.units for p in u.params]
    assert len(everything) == len(set(everything)) == len([p for p in model.parameters() if p.requires_grad])
    assert sum(u.shard_numel for u in plan.units) == plan.group_numels[0]


def _transitions(rank: int, world: int) -> dict:
    from zerorun import config
    from zerorun.runtime.collectives import Collectives
    from zerorun.runtime.dist import init_distributed
    from zerorun.runtime.placement import Placement
    from zerorun.runtime.precision import PrecisionPolicy
    from zerorun.runtime.sharded_params import ShardedParams

    info = init_distributed()
    model, plan = _plan(threshold=30, world=world)
    weight = model.blocks[0].fc.weight
    original = weight.detach().clone()
    recipe = config.loads("script: t.py", "t.yaml", ["zero.stage=3"])
    store = ShardedParams(model, plan, Placement.from_recipe(recipe, info.device, rank), PrecisionPolicy(), Collectives())
    from zerorun.runtime.flat_params import FlatParams
    from zerorun.runtime.homes import Home
    from zerorun.runtime.store import ParamStore

    flat = FlatParams([list(tied_gpt(1).parameters())], Placement.from_recipe(recipe, info.device, rank),
                      PrecisionPolicy(), Collectives(), world, 100)
    block = plan.module_units[0]
    out = {"protocols": all(isinstance(s, ParamStore) and isinstance(s.home, Home) for s in (store, flat)),
           "released_is_empty": weight.numel() == 0 and block.state is UnitState.RELEASED,
           "persistent_gathered": plan.persistent.state is UnitState.GATHERED}
    refused = []
    for wrong in (store.finish_gather, store.release):
        try:
            wrong(block)
        except AssertionError as exc:
            refused.append(str(exc))
    store.start_gather(block)
    try:
        store.start_gather(block)
    except AssertionError as exc:
        refused.append(str(exc))
    store.finish_gather(block)
    out["gathered_values"] = torch.equal(weight.detach(), original)
    out["refused"] = refused
    store.release(block)
    store.prefetch(block)
    out["prefetch_starts"] = block.state is UnitState.GATHERING
    store.prefetch(block)
    store.ensure_gathered(block)
    store.ensure_gathered(block)
    out["ensure_finishes"] = block.state is UnitState.GATHERED
    store.release_if_held(block)
    store.release_if_held(block)
    out["release_if_held"] = block.state is UnitState.RELEASED and weight.numel() == 0
    return out


def test_transitions_assert_their_starting_state_and_the_helpers_forgive() -> None:
    out = run_ranks(_transitions, 2)[0]
    refused = out.pop("refused")
    assert all(out.values()), out
    assert refused == ["stage 3 unit blocks.0: expected gathering, but it is released",
                       "stage 3 unit blocks.0: expected gathered, but it is released",
                       "stage 3 unit blocks.0: expected released, but it is gathering"], refused
