"""Stages 0-2's parameter store: whole parameters on every rank, as views into one flat buffer.

Trainable parameters are grouped by optimizer param group, ordered as backward produces their
gradients (reverse registration order, as DDP does) and cut into units of about `bucket_mb`,
back to back in one flat buffer:

    flat buffer (all units, compute dtype)   | unit 0            | unit 1        | ...
    a unit                                   | r0 | r1 | r2 |      (equal pieces, padded)
    this rank's optimizer state, per group   | u0.r1 | u1.r1 | ...  (one contiguous fp32 tensor)

Making a unit the sharding granule (rather than the whole model) means every gradient bucket is
reduce-scattered, and every updated unit all-gathered, with one collective over equal pieces, the
same mechanism stage 3 uses per module. Module parameters are views into the flat buffer, so tied
parameters stay tied and nothing is copied per parameter. Stage 0 is the same picture with a world
of one: every rank owns everything.

The master weights live in the home the placement chose. In fp32 with the optimizer in device
memory, the master *is* this rank's own pieces of the flat buffer (the home is built around
them); otherwise the step writes each update's compute-dtype copy into those pieces.

With `zero.quantized_weights` (qwZ) the publish all-gathers the updated units as block int8 where
they cross the network: half of a stage 2 step's bytes, so this is what brings quantized
communication below DDP's over a slow link (`zerorun bench step --cluster 2x1`). Every rank, the
owner included, then computes with the same dequantized values, so the replicas agree; the master
is kept apart from the flat buffer (4 bytes per parameter / world size, also in fp32), stays
exact and is what the next step updates and what checkpoints save.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Iterable

import torch
from torch import nn

from zerorun.runtime.comm.collectives import Collectives, Pending
from zerorun.runtime.deferred_publish import DeferredPublish
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.offload.homes import MASTER
from zerorun.runtime.offload.placement import Place, Placement
from zerorun.runtime.ownership import Balance
from zerorun.runtime.precision import PrecisionPolicy
from zerorun.runtime.store import (
    InMaster,
    ParamTensor,
    UpdateTarget,
    master_state_dict,
    saved_masters,
    units_of,
)
from zerorun.runtime.units import Unit, cut_units, group_numels


class FlatParams:
    """The stages 0-2 `ParamStore`: the flat parameter buffer; the master in the placement's home."""

    def __init__(self, groups: list[list[nn.Parameter]], placement: Placement, policy: PrecisionPolicy,
                 comm: Collectives, shard_world: int, bucket_numel: int, defer_to: nn.Module | None = None,
                 state_kinds: list[tuple[str, ...]] | None = None, whole: list[Balance | None] | None = None) -> None:
        """`defer_to`: with `zero.overlap_publish`, the model whose next forward waits for the post-step
        all-gather (deferred_publish.py); None publishes within `step()`. `state_kinds`: per group, what its
        optimizer keeps per element beside the master (the home's kinds). `whole`: per group, the owner way's
        balance (its units hold whole parameters per rank, each rank's piece about a bucket), or None."""
        self.comm, self.device = comm, placement.device
        self.shard_world = shard_world  # 1 for stage 0: no sharding
        self.shard_rank = comm.rank if shard_world > 1 else 0
        self.units: list[Unit] = []
        for g, params in enumerate(groups):  # gradients arrive roughly in reverse registration order
            flat_offset = self.units[-1].flat_offset + self.units[-1].padded_numel if self.units else 0
            balance = whole[g] if whole else None
            self.units += cut_units(g, list(reversed(params)), bucket_numel * (shard_world if balance else 1),
                                    shard_world, policy.param_dtype, flat_offset=flat_offset, whole=balance)
        self.group_numels = group_numels(self.units, len(groups))
        self.quantized_publish = comm.quantized_weights and shard_world > 1  # the buffer is a compute copy
        self.params_are_master = (placement.optimizer is Place.DEVICE and policy.param_dtype == torch.float32
                                  and not self.quantized_publish)
        self.buffer = torch.empty(sum(u.padded_numel for u in self.units), dtype=policy.param_dtype,
                                  device=self.device)
        starts = [[u.state_offset for u in units_of(self.units, g)] for g in range(len(groups))]
        home = None if self.params_are_master else placement.optimizer_home(self.group_numels, unit_starts=starts,
                                                                             state_kinds=state_kinds)
        for unit in self.units:  # one unit at a time: the script's parameters go as their unit is filled
            values = self._rank0_values(unit)
            self.unit_full(unit).copy_(values)
            if home is not None:
                home.write(unit.group, MASTER, unit.piece(values, self.shard_rank), start=unit.state_offset)
            for span, param in zip(unit.layout.spans, unit.params):
                start = unit.flat_offset + span.offset
                param.data = self.buffer[start:start + span.numel].view(param.shape)
        if home is None:
            own = [[(u.state_offset, self.own_piece(u)) for u in units_of(self.units, g)] for g in range(len(groups))]
            home = placement.optimizer_home(self.group_numels, master=own, state_kinds=state_kinds)
        self.home = home
        # stages 1/2 with overlap_publish: the post-step all-gather lands under the next forward
        self.deferred = DeferredPublish(defer_to, self.units) if defer_to is not None and shard_world > 1 else None

    def _rank0_values(self, unit: Unit) -> torch.Tensor:
        """The unit's parameter values, fp32, laid out flat with its padding zeroed, equal to rank 0's on every rank.
        A unit at a time: a whole-model fp32 copy beside the model the script built set the GPU's peak at setup."""
        values = torch.zeros(unit.padded_numel, dtype=torch.float32, device=self.device)
        for span, param in zip(unit.layout.spans, unit.params):
            values[span.offset:span.end].copy_(param.detach().view(-1))
        self.comm.broadcast(values, src=0).wait()
        return values

    def unit_full(self, unit: Unit, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's whole region of `buffer` (default: the flat parameter buffer)."""
        buffer = self.buffer if buffer is None else buffer
        return buffer[unit.flat_offset:unit.flat_offset + unit.padded_numel]

    def own_piece(self, unit: Unit, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's piece of the unit inside a full-size `buffer` (default: the parameters)."""
        return unit.piece(self.unit_full(unit, buffer), self.shard_rank)

    # -- the ParamStore interface -------------------------------------------------------------------
    def update_targets(self, group: int) -> list[UpdateTarget]:
        if self.params_are_master:  # the kernel updated the parameters themselves
            return [InMaster() for _ in units_of(self.units, group)]
        return [ParamTensor(self.own_piece(u)) for u in units_of(self.units, group)]

    def publish(self) -> Pending:
        """Every rank's parameters from the updated pieces: one all-gather per unit."""
        return Pending([h for p in self.publish_units(range(len(self.units))).values() for h in p.handles])

    def publish_units(self, order: Iterable[int]) -> dict[int, Pending]:
        """`publish`, one `Pending` per unit index, started in `order` (the order they will be waited for)."""
        if self.shard_world == 1:
            return {}
        return {k: Pending([self.comm.all_gather(self.unit_full(self.units[k]), compute_copy=self.quantized_publish,
                                                 unit=k, used=self.units[k].layout.used)])
                for k in order}

    def publish_after_step(self) -> None:
        """Publish the step's update: deferred, each unit waited for by the next forward's hooks; or now."""
        if self.deferred is not None:
            self.deferred.start(self.publish_units)
        else:
            self.publish().wait()

    def settle(self) -> None:
        if self.deferred is not None:  # the deferred publish is the only collective left between steps
            self.deferred.wait_all()

    def saved_master(self) -> dict[str, torch.Tensor]:
        return saved_masters(self.home, len(self.group_numels))

    def restore_master(self, group: int, values: torch.Tensor) -> None:
        self.home.write(group, MASTER, values)
        if self.params_are_master:
            return  # the home wrote them
        for unit in units_of(self.units, group):
            self.own_piece(unit).copy_(unit.state_slice(values))

    def gathered(self, params: Iterable[nn.Parameter] | None = None, modify: bool = False,
                 src: int = 0) -> AbstractContextManager:
        return contextlib.nullcontext()  # every rank holds whole parameters

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        if self.buffer.dtype == torch.float32 and not self.quantized_publish:  # the parameters equal their master
            return module.state_dict()
        return master_state_dict(module, self, self.comm, every_rank=True)

    def account(self, report: MemoryReport) -> None:
        report.add("params", self.device.type, self.buffer.numel() * self.buffer.element_size())
