"""The parameter store: the one interface the engine, the optimizer step and checkpoints use.

Two stores implement `ParamStore`:

| store           | stages | parameters between steps                      | after a step (`publish`)               |
|-----------------|--------|-----------------------------------------------|----------------------------------------|
| `FlatParams`    | 0-2    | whole, views into one flat buffer             | all-gather each unit's updated pieces  |
| `ShardedParams` | 3      | this rank's shard; units gathered around use  | refresh the units gathered right now   |

Both lay parameters out in `Unit`s (units.py) and keep this rank's optimizer state in a `Home`
(homes.py) that the placement chose. An optimizer step reads the reduced gradients from the
reducer, updates the home's state tile by tile, and writes each unit's updated compute-dtype
values to its `UpdateTarget`; `publish` then makes every rank's parameters current. The store owns
the master weights (the fp32 truth of the parameters): a checkpoint saves what `saved_master` yields and
hands it back through `restore_master`, and never reaches past them; the optimizer's own state is the
optimizer's (optim/update.py).
Stage 3 alone also acts around every pass (gather, prefetch, release): that is `UnitPasses`, a second
Protocol, so neither store carries methods that do nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, runtime_checkable

import torch
from torch import nn

from zerorun.runtime.comm.collectives import Collectives, Pending
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.offload.homes import MASTER, Home
from zerorun.runtime.offload.transfers import Transfers
from zerorun.runtime.units import Unit


class UpdateTarget(Protocol):
    """Where the optimizer step sends one unit's updated piece (compute dtype)."""

    def staging(self, transfers: Transfers, lo: int, hi: int) -> torch.Tensor | None:
        """Where the kernel writes elements [lo, hi) of the piece; None: nothing to write (see `InMaster`)."""

    def deliver(self, transfers: Transfers, lo: int, hi: int, staged: torch.Tensor) -> None:
        """Hand the written elements on to the parameters (a copy to the device, a file write, or nothing)."""


class InMaster:
    """The parameters are read from the fp32 master itself: fp32 stages 0-2 (the master is the
    parameters' own pieces) and stage 3 without offload (gathers cast from the master)."""

    def staging(self, transfers: Transfers, lo: int, hi: int) -> None:
        return None

    def deliver(self, transfers: Transfers, lo: int, hi: int, staged: torch.Tensor) -> None:
        raise AssertionError("nothing is staged for parameters that are the master")


class ParamTensor:
    """The piece lives in a tensor (the flat buffer's own piece, or stage 3's compute-dtype shard)."""

    def __init__(self, piece: torch.Tensor) -> None:
        self.piece = piece

    def staging(self, transfers: Transfers, lo: int, hi: int) -> torch.Tensor:
        dest = self.piece[lo:hi]
        return dest if transfers.reaches(dest) else transfers.out_slot(hi - lo, dest.dtype)

    def deliver(self, transfers: Transfers, lo: int, hi: int, staged: torch.Tensor) -> None:
        dest = self.piece[lo:hi]
        if not transfers.reaches(dest):
            transfers.send(dest, staged)


class ParamFile:
    """The piece lives in a file (stage 3's shard under `offload_param: nvme`): updates are written through."""

    def __init__(self, write: Callable[[int, torch.Tensor], None], dtype: torch.dtype) -> None:
        self.write, self.dtype = write, dtype  # write(offset inside the piece, values)

    def staging(self, transfers: Transfers, lo: int, hi: int) -> torch.Tensor:
        return transfers.out_slot(hi - lo, self.dtype)

    def deliver(self, transfers: Transfers, lo: int, hi: int, staged: torch.Tensor) -> None:
        self.write(lo, staged)


@dataclass(frozen=True)
class ParamIO:
    """What this rank's parameter shard read and wrote outside memory since the start (stage 3's parameters on
    NVMe), and the seconds the caller waited on it; zeros where the parameters live in memory."""

    read_bytes: int = 0
    written_bytes: int = 0
    blocked_s: float = 0.0


@runtime_checkable
class ParamStore(Protocol):
    """Where the trainable parameters live between steps, and how every rank gets the updated values: what the
    engine, the optimizer step, checkpoints and the gradient reducer use at every stage."""

    units: list[Unit]  # in optimizer-state order per group (each unit's `state_offset`)
    group_numels: list[int]  # elements of this rank's state per param group
    shard_world: int  # ranks the state is sharded over (1 at stage 0)
    shard_rank: int
    home: Home  # this rank's master weights and flat optimizer state: what the step updates and a save captures
    device: torch.device

    def update_targets(self, group: int) -> list[UpdateTarget]:
        """Where each of `group`'s units (in state order) gets its updated piece."""

    def publish(self) -> Pending:
        """After an update: every rank's parameters from the updated shards (`wait()` before reading them)."""

    def publish_after_step(self) -> None:
        """After an applied update: `publish`, waited for here or (stages 1/2 with `overlap_publish`) by the
        next forward's hooks; stage 3 then starts gathering the next forward's first units (`overlap_comm`)."""

    def settle(self) -> None:
        """Finish every collective still in flight (the deferred publish, stage 3's prefetched gathers): before
        the process group is torn down, which aborts a gloo process whose collectives are still running."""

    def gathered(self, params: Iterable[nn.Parameter] | None, modify: bool, src: int) -> AbstractContextManager:
        """Full parameters inside the block; with `modify`, rank `src`'s values are written back."""

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict, trainable parameters in fp32 at every precision (their master): on every
        rank at stages 0-2; stage 3 consolidates on rank 0 ({} elsewhere)."""

    def account(self, report: MemoryReport) -> None:
        """Add the bytes of parameters (and their own buffers) this store holds to `report`."""

    # -- what a checkpoint saves and restores -----------------------------------------------------------
    def saved_master(self) -> dict[str, torch.Tensor]:
        """This rank's flat fp32 master, `master.<group>` -> a CPU tensor of `group_numels[group]` elements."""

    def restore_master(self, group: int, values: torch.Tensor) -> None:
        """Overwrite this rank's flat master of `group` with `values` (a checkpoint load); parameters follow it at
        the next `publish`."""


@runtime_checkable
class UnitPasses(Protocol):
    """What only stage 3 does around each pass, beside its `ParamStore`: its units are gathered and released
    around their use by module hooks (`ScheduledParams`). Stages 0-2 have none (the engine holds None)."""

    def forward_context(self) -> AbstractContextManager:
        """Entered around every engine forward: the first pass's watch for parameters used outside their unit."""

    def begin_backward(self) -> None:
        """A backward starts: the scheduler's per-pass state."""

    def end_backward(self) -> None:
        """A backward ended, or raised: units gathered for it are released."""

    def param_io(self) -> ParamIO:
        """The parameter shard's file I/O so far (zeros unless the parameters live on NVMe)."""

    def remove_hooks(self) -> None:
        """Take the module hooks off the model (the engine is destroyed)."""


def flat_name(kind: str, group: int) -> str:
    """A flat state tensor's name in a rank file: `<kind>.<group>` (`master.0`, `exp_avg.1`)."""
    return f"{kind}.{group}"


def flat_names(kinds: list[tuple[str, ...]]) -> list[tuple[str, int, str]]:
    """(tensor name, group, kind) of a rank file's flat state, in the file's order; `kinds`: per group, the home's
    (the master first)."""
    return [(flat_name(kind, g), g, kind) for g, group in enumerate(kinds) for kind in group]


def saved_masters(home: Home, groups: int) -> dict[str, torch.Tensor]:
    """`ParamStore.saved_master` of a store whose master is in `home`."""
    return {flat_name(MASTER, g): home.state(g, MASTER) for g in range(groups)}


def first_names(module: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's first name in `module` (a tied one has several): what checkpoints and messages call it."""
    names: dict[nn.Parameter, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, name)
    return names


def units_of(units: list[Unit], group: int) -> list[Unit]:
    """`group`'s units in state order."""
    return [u for u in units if u.group == group]


def master_state_dict(module: nn.Module, store: ParamStore, comm: Collectives,
                      every_rank: bool) -> dict[str, torch.Tensor]:
    """The model's state dict with every trainable parameter as its fp32 master, gathered one unit at a time
    (on every rank, or on rank 0 with {} elsewhere); buffers and frozen parameters as they are."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    values: dict[str, torch.Tensor] = {}
    for unit in store.units:
        full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=store.device)
        store.home.read(unit.group, MASTER, unit.piece(full, store.shard_rank), start=unit.state_offset)
        if store.shard_world > 1:
            comm.all_gather(full, used=unit.layout.used).wait()
        if every_rank or store.shard_rank == 0:
            for span, param, shape in zip(unit.layout.spans, unit.params, unit.shapes):
                for name in names[param]:
                    values[name] = full[span.offset:span.end].view(shape).cpu().clone()
    if not (every_rank or store.shard_rank == 0):
        return {}
    return {key: values[key] if key in values else value.detach().cpu().clone()
            for key, value in module.state_dict(keep_vars=True).items()}
