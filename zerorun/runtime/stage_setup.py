"""Which parameter store and gradient reducer a ZeRO stage uses, built once from the recipe at `initialize`.

Stages 0-2 keep whole parameters as views into one flat buffer (`FlatParams`), optionally publishing
the post-step all-gather under the next forward (`DeferredPublish`); stage 3 plans its units, shards
them (`ScheduledParams`) and reduce-scatters each unit's gradients as soon as backward completes it.
The engine drives whatever this returns through the `ParamStore` Protocol only, and stage 3's
scheduler through `UnitPasses`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from torch import nn

from zerorun.config import Recipe
from zerorun.runtime import compiled
from zerorun.runtime.comm.collectives import Collectives
from zerorun.runtime.deferred_publish import DeferredPublish, publish_overlaps
from zerorun.runtime.flat_params import FlatParams
from zerorun.runtime.grad_reducer import GradReducer, LaunchOrder, Reduction
from zerorun.runtime.offload.placement import Placement
from zerorun.runtime.ownership import Balance, Cost
from zerorun.runtime.phase import TrainingPhase
from zerorun.runtime.precision import PrecisionPolicy
from zerorun.runtime.stage3.hpz import SecondaryPartition
from zerorun.runtime.stage3.module_units import describe as describe_plan
from zerorun.runtime.stage3.module_units import plan_stage3, warn_if_nothing_sharded
from zerorun.runtime.stage3.scheduled_params import ScheduledParams
from zerorun.runtime.stage3.sharded_init import InitLog
from zerorun.runtime.store import ParamStore, UnitPasses


class GroupCut(Protocol):
    """What the stage needs of a param group (the engine's `EngineGroup`)."""

    params: list[nn.Parameter]
    kinds: tuple[str, ...]  # what its optimizer keeps per element of the flat shard beside the master

    @property
    def whole(self) -> Cost | None:
        """The owner way: each parameter lies whole in one rank's piece, balanced by this cost; None: flat pieces."""


@dataclass
class Stage:
    """What the engine holds of its stage."""

    store: ParamStore
    passes: UnitPasses | None  # stage 3: the scheduler's work around every pass; None at stages 0-2
    reducer: GradReducer
    deferred: DeferredPublish | None  # stages 1/2 with zero.overlap_publish: the publish the root's reads wait for


def build_stage(recipe: Recipe, model: nn.Module, cuts: Sequence[GroupCut], init_log: InitLog | None,
                comm: Collectives, placement: Placement, policy: PrecisionPolicy, phase: TrainingPhase,
                device: torch.device, seen: compiled.CompiledModel) -> Stage:
    """The stage's parameter store (at stage 3 with its scheduler) and the gradient reducer around it, for the
    param groups `cuts`."""
    zero, stage = recipe.zero, recipe.zero.stage
    groups, state_kinds = [c.params for c in cuts], [c.kinds for c in cuts]
    if stage < 3:
        shard_world = 1 if stage == 0 else comm.world_size
        defer_to = model if publish_overlaps(zero.overlap_publish, comm.world_size) else None
        whole = [Balance(c.whole, shard_world) if c.whole else None for c in cuts]
        store = FlatParams(groups, placement, policy, comm, shard_world, numel(zero.bucket_mb), defer_to, state_kinds,
                           whole)
        reducer = GradReducer(store, comm, policy.reduce_dtype, device, Reduction.for_stage(stage),
                              LaunchOrder.LAYOUT, zero.overlap_comm, phase)
        return Stage(store, None, reducer, store.deferred)
    plan = plan_stage3(model, groups, zero.wrap, zero.param_persistence_threshold, numel(zero.bucket_mb),
                       numel(zero.allgather_bucket_mb), comm.world_size, policy.param_dtype,
                       [Balance(c.whole, comm.world_size) if c.whole else None for c in cuts])
    units = plan.gathered_units()
    compiled.refuse_unworkable(seen, stage, [(g.name, g.module) for g in units])
    if comm.rank == 0:
        print(describe_plan(plan), flush=True)
        warn_if_nothing_sharded(plan, zero.wrap, zero.param_persistence_threshold)
        note = compiled.stage3_whole_model_note(seen, len(units))
        if note is not None:
            print(note, flush=True)
    hpz = (SecondaryPartition(plan.units, comm, zero.hpz_partition_size, zero.cpu_collectives,
                              recipe.launch.timeout_s) if zero.hpz_partition_size > 1 else None)
    say = (lambda text: print(text, flush=True)) if comm.rank == 0 else None
    prefetch = units_ahead(zero.prefetch_units, cuts)
    if say is not None and zero.prefetch_units == "auto" and prefetch > 1:
        say(f"zerorun: stage 3: {prefetch} units gathered ahead (zero.prefetch_units: auto): a group on whole "
            "parameters makes each unit's gather uneven")
    sharded = ScheduledParams(model, plan, placement, policy, comm, init_log, hpz, prefetch=prefetch,
                              phase=phase, prefetch_after_step=zero.overlap_comm, say=say, state_kinds=state_kinds)
    # each unit's group reduce-scatters its gradients as soon as backward completes them, then releases itself
    reducer = GradReducer(sharded, comm, policy.reduce_dtype, device, Reduction.SCATTER_SHARD, LaunchOrder.READY,
                          zero.overlap_comm, phase)
    assert sorted(k for group in plan.groups for k in group.slots) == list(range(len(plan.units))), \
        "every stage 3 unit belongs to exactly one group, whose hooks reduce its gradients"
    for group in plan.groups:
        group.reduce_with(reducer)
    return Stage(sharded, sharded, reducer, None)


def units_ahead(prefetch_units: int | str, cuts: Sequence[GroupCut]) -> int:
    """`zero.prefetch_units` as a count: auto is 2 where a param group runs on whole parameters (its pieces are
    uneven: with one gather in flight a link idles one way while the fuller piece crosses the other), else 1."""
    if prefetch_units != "auto":
        return int(prefetch_units)
    return 2 if any(c.whole for c in cuts) else 1


def cast_frozen(module: nn.Module, dtype: torch.dtype) -> None:
    """Frozen parameters follow the compute dtype (they are not sharded)."""
    if dtype == torch.float32:
        return
    for param in module.parameters():
        if not param.requires_grad and param.is_floating_point():
            param.data = param.data.to(dtype)


def numel(mib: float) -> int:
    """fp32 elements in `mib` MiB (at least one)."""
    return max(1, int(mib * 2**20 // 4))
