"""Flat parameter storage for stages 0-2: units, the gathered buffer, and this rank's pieces.

Trainable parameters are grouped by optimizer param group, ordered as backward produces their
gradients (reverse registration order, as DDP does) and cut into *units* of about `bucket_mb`.
Each unit is one `FlatLayout`, sharded across ranks on its own:

    flat buffer (all units, compute dtype)   | unit 0            | unit 1        | ...
    a unit                                   | r0 | r1 | r2 |      (equal pieces, padded)
    this rank's optimizer state, per group   | u0.r1 | u1.r1 | ...  (one contiguous fp32 tensor)

Making a unit the sharding granule (rather than the whole model) means every gradient bucket is
reduce-scattered, and every updated unit all-gathered, with one collective over equal pieces, the
same mechanism stage 3 uses per module. Module parameters are views into the flat buffer, so
tied parameters stay tied and nothing is copied per parameter. Stage 0 is the same picture with a
world of one: every rank owns everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerorun.runtime.collectives import Collectives
from zerorun.runtime.partition import FlatLayout, bucket_params, flat_layout
from zerorun.runtime.precision import PrecisionPolicy

ALIGN_BYTES = 64  # each shard starts on a cache line / vector boundary


@dataclass
class Unit:
    """A bucket of parameters laid out and sharded together."""

    group: int  # optimizer param group
    params: list[nn.Parameter]
    layout: FlatLayout
    flat_offset: int  # start of the unit in the flat buffer
    state_offset: int  # start of this rank's piece in its group's optimizer state

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel


class FlatParams:
    """Owns the flat parameter buffer and the fp32 master pieces of this rank."""

    def __init__(self, groups: list[list[nn.Parameter]], policy: PrecisionPolicy, comm: Collectives,
                 shard_world: int, bucket_numel: int, device: torch.device,
                 master_device: torch.device | None = None) -> None:
        """`master_device`: keep a separate fp32 master there (optimizer offload), even for fp32 parameters."""
        self.policy = policy
        self.master_device = master_device or device
        self.separate_master = policy.separate_master or master_device is not None
        self.comm = comm
        self.shard_world = shard_world  # 1 for stage 0: no sharding
        self.shard_rank = comm.rank if shard_world > 1 else 0
        self.device = device
        self.units = self._plan_units(groups, bucket_numel)
        self.group_numels = [sum(u.layout.shard_numel for u in self.units if u.group == g) for g in range(len(groups))]
        total = sum(u.padded_numel for u in self.units)
        self.flat = self._build_flat(total)
        self.master = self._build_master()

    def _plan_units(self, groups: list[list[nn.Parameter]], bucket_numel: int) -> list[Unit]:
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=self.policy.param_dtype).element_size())
        units, flat_offset = [], 0
        for g, params in enumerate(groups):
            ordered = list(reversed(params))  # gradients arrive roughly in reverse registration order
            state_offset = 0
            for indices in bucket_params([p.numel() for p in ordered], bucket_numel):
                members = [ordered[i] for i in indices]
                layout = flat_layout([p.numel() for p in members], self.shard_world, align)
                units.append(Unit(g, members, layout, flat_offset, state_offset))
                flat_offset += layout.padded_numel
                state_offset += layout.shard_numel
        return units

    def _build_flat(self, total: int) -> torch.Tensor:
        """Copy parameters into one fp32 buffer, make every rank agree with rank 0, then cast."""
        staging = torch.zeros(total, dtype=torch.float32, device=self.device)
        for unit in self.units:
            for span, param in zip(unit.layout.spans, unit.params):
                staging[unit.flat_offset + span.offset:unit.flat_offset + span.end].copy_(param.detach().view(-1))
        handles = [self.comm.broadcast(self.unit_full(unit, staging), src=0) for unit in self.units]
        for handle in handles:
            handle.wait()
        self._fp32_staging = staging  # read once by _build_master for a separate master
        flat = staging.to(self.policy.param_dtype)  # fp32: the staging buffer itself
        for unit in self.units:
            for span, param in zip(unit.layout.spans, unit.params):
                start = unit.flat_offset + span.offset
                param.data = flat[start:start + span.numel].view(param.shape)
        return flat

    def _build_master(self) -> list[torch.Tensor] | None:
        """fp32 master pieces per group: a separate tensor for bf16/fp16 or when offloaded, else None
        (the fp32 parameters are their own master)."""
        staging, self._fp32_staging = self._fp32_staging, None
        if not self.separate_master:
            return None
        master = [torch.empty(n, dtype=torch.float32, device=self.master_device) for n in self.group_numels]
        for unit in self.units:
            self.state_slice(unit, master[unit.group]).copy_(self.unit_piece(unit, staging))
        return master

    # -- views ------------------------------------------------------------------------------
    def unit_full(self, unit: Unit, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The unit's whole (gathered) region of `buffer` (default: the flat parameter buffer)."""
        buffer = self.flat if buffer is None else buffer
        return buffer[unit.flat_offset:unit.flat_offset + unit.padded_numel]

    def unit_piece(self, unit: Unit, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's piece of the unit inside a full-size `buffer`."""
        start, end = unit.layout.shard_range(self.shard_rank)
        return self.unit_full(unit, buffer)[start:end]

    @staticmethod
    def state_slice(unit: Unit, group_state: torch.Tensor) -> torch.Tensor:
        """The unit's part of a per-group, per-rank state tensor (master, moments, gradient shard)."""
        return group_state[unit.state_offset:unit.state_offset + unit.layout.shard_numel]

    def master_pieces(self, group: int) -> list[torch.Tensor]:
        """The fp32 tensors the optimizer updates for `group` (views)."""
        units = [u for u in self.units if u.group == group]
        if self.master is None:
            return [self.unit_piece(u) for u in units]
        return [self.state_slice(u, self.master[group]) for u in units]

    def shard_pieces(self, group: int) -> list[torch.Tensor]:
        """This rank's own pieces of the parameter buffer for `group` (compute dtype), in unit order."""
        return [self.unit_piece(u) for u in self.units if u.group == group]

    # -- after an optimizer step ------------------------------------------------------------
    def lowp_pieces(self, group: int) -> list[torch.Tensor] | None:
        """Where the optimizer writes the cast update for `group` (own pieces of the param buffer), or
        None when the parameters are the fp32 master themselves."""
        if self.master is None:
            return None
        return self.shard_pieces(group)

    def publish(self, cast_done: bool = False) -> None:
        """Make every rank's parameters equal the updated master: cast own pieces (unless the
        optimizer already wrote them), then all-gather."""
        if self.master is not None and not cast_done:
            for unit in self.units:
                self.unit_piece(unit).copy_(self.state_slice(unit, self.master[unit.group]))
        if self.shard_world == 1:
            return
        handles = [self.comm.all_gather(self.unit_full(unit)) for unit in self.units]
        for handle in handles:
            handle.wait()

    def numel(self) -> int:
        return sum(u.layout.numel for u in self.units)
