"""This rank's optimizer: every param group's update and state, in the one object an engine steps.

    update = Update(groups, store, grad_pieces, placement, comm, names)   # at zerorun.initialize
    update.apply(divisor, clamped)      # engine.step() at a boundary: every group's update
    update.saved_tensors() / update.describe(...) / update.load(saved)      # checkpoints compose these

Each of the engine's param groups (take_over.py) runs one way (ways.py):

| way           | runner                                  | its state                                      |
|---------------|-----------------------------------------|------------------------------------------------|
| `FUSED_ADAM`  | `FlatStep` + `FusedAdam` (flat_step.py)  | `exp_avg`, `exp_avg_sq` in the home; `FusedGroup`'s step count |
| `ELEMENTWISE` | `FlatStep` + `TorchTiles` (elementwise.py) | its kinds in the home; `ElementwiseGroup`'s scalars |
| `OWNER`       | `OwnerStep` (owner_step.py)              | the script's optimizer's, per owned parameter   |

The flat ways share one pass per group over the home's tiles (device, host or NVMe); the owner way
runs after them. With the optimizer on the host and `zero.overlap_optimizer`, the fused groups are
updated, and the owner way's parameters stepped, under the backward (`OverlappedUpdate`, overlap.py;
`OwnerSpeculation`, owner_overlap.py) and `apply` commits or rolls that back; `settle()` rolls back
a speculation that no step has claimed, before anything reads the state.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any, Callable, Collection, Iterator, Protocol

import torch
from torch import nn

from zerorun.runtime.comm.collectives import Collectives
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.offload.homes import MASTER
from zerorun.runtime.offload.placement import Place, Placement
from zerorun.runtime.offload.transfers import Direct, Transfers
from zerorun.runtime.optim.elementwise import ElementwiseGroup, State, TorchTiles
from zerorun.runtime.optim.flat_step import FlatStep, FusedAdam, Piece
from zerorun.runtime.optim.optimizer import ShardedOptimizer
from zerorun.runtime.optim.overlap import OverlappedUpdate
from zerorun.runtime.optim.owner_overlap import OwnerSpeculation
from zerorun.runtime.optim.owner_step import OwnedFiles, OwnedHost, OwnerStep
from zerorun.runtime.optim.state_json import owned_to_json, scalars_to_json
from zerorun.runtime.optim.take_over import EngineGroup
from zerorun.runtime.optim.ways import Way, decoupled
from zerorun.runtime.ranges import Ranges
from zerorun.runtime.store import ParamStore, flat_name, units_of


class FusedGroup:
    """A param group of zerorun's fused Adam(W) kernel: its step count and the kernel's arguments."""

    def __init__(self, group: EngineGroup, steps: int = 0) -> None:
        self.hyper = group.hyper  # the script's group dict: a scheduler's lr is read at every step
        self.decoupled = decoupled(group.optimizer, group.hyper)
        self.steps = steps  # a Python int: no device sync to read it

    def arguments(self, grad_divisor: float) -> dict[str, Any]:
        """The kernel's arguments for the group's next update, as they stand now (`ops.adamw_step`)."""
        hyper = self.hyper
        beta1, beta2 = hyper["betas"]
        return dict(step=self.steps + 1, lr=float(hyper["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(hyper["eps"]), weight_decay=float(hyper["weight_decay"]),
                    decoupled=self.decoupled, grad_divisor=grad_divisor)

    def kernel(self, grad_divisor: float) -> FusedAdam:
        """The kernel of the group's next update, counted."""
        kernel = FusedAdam(self.arguments(grad_divisor))
        self.steps += 1
        return kernel

    @property
    def scalars(self) -> State | None:
        return {"step": torch.tensor(float(self.steps))} if self.steps else None


class SavedState(Protocol):
    """A checkpoint's optimizer state, as the update reads it back (checkpoint/optimizer_state.py implements it)."""

    def scalars(self, group: int) -> State | None:
        """The group's saved scalars (None: it had not stepped)."""

    def read(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        """Elements [lo, hi) of parameter `name`'s state `kind`, flat, wherever they were saved (None: not saved)."""

    def whole(self, name: str, shape: torch.Size) -> State:
        """Parameter `name`'s whole state, as its owner keeps it ({} when none was saved)."""


class Update:
    """Every param group's update and state on this rank (see the module docstring)."""

    def __init__(self, groups: list[EngineGroup], face: ShardedOptimizer, store: ParamStore,
                 grad_pieces: list[list[torch.Tensor]], placement: Placement, comm: Collectives,
                 names: dict[nn.Parameter, str], ranges: Ranges | None = None) -> None:
        """`face`: the torch Optimizer the script sees (its param groups are the groups'); `grad_pieces`: per group, the
        reducer's gradient piece of each unit in state order; `names`: each parameter's (checkpoints, messages)."""
        self.groups, self.face, self.store, self.names = groups, face, store, names
        self.ranges = ranges or Ranges()  # the runtime's: the optimizer and its copies in a profile's trace
        self.pieces = [[Piece(g, u.state_offset, u.shard_numel, grad, target)
                        for u, grad, target in zip(units_of(store.units, g), grad_pieces[g], store.update_targets(g),
                                                   strict=True)] for g in range(len(groups))]
        largest_piece = max((u.shard_numel for u in store.units), default=1)
        self.flat = FlatStep(store.home, offload_copies(placement.transfers(largest_piece), self.ranges),
                             placement.step_tile_numel, Direct(store.device), store.device)
        self.fused = {g: FusedGroup(group) for g, group in enumerate(groups) if group.way is Way.FUSED_ADAM}
        self.elementwise = {g: ElementwiseGroup(group.optimizer, group.index, group.kinds, group.scalars, group.where)
                            for g, group in enumerate(groups) if group.way is Way.ELEMENTWISE}
        owned = {g: (group.optimizer, group.index) for g, group in enumerate(groups) if group.way is Way.OWNER}
        self.owner = OwnerStep(owned, store, self.pieces, store.device, placement.tile_numel, names,
                               _owned_home(placement, store.device)) if owned else None
        self.overlap: OverlappedUpdate | None = None  # the host's fused groups under the backward (overlap.py)
        self._stepping: Counter[int] = Counter()  # threads calling a script's optimizer for the engine (let through)
        self._place_carried(comm)

    # -- the step -------------------------------------------------------------------------------
    def grads(self) -> list[torch.Tensor]:
        """Every group's reduced gradient pieces on this rank (their norm, their clamp)."""
        return [piece.grad for group in self.pieces for piece in group]

    def overlap_with_backward(self, say: Callable[[str], None] | None) -> OverlappedUpdate:
        """Update the fused groups on the host, and step the owner way's parameters, under the backward, from now on
        (overlap.py, owner_overlap.py)."""
        fused = {g: self.pieces[g] for g in self.fused}
        in_order = {g: iter(pieces) for g, pieces in fused.items()}
        owned = OwnerSpeculation(self.owner, self.stepping) if self.owner is not None and self.owner.owned else None
        self.overlap = OverlappedUpdate(self.flat, self.fused, fused,
                                        [next(in_order[u.group]) if u.group in fused else None for u in self.store.units],
                                        self.store.group_numels, self.ranges, owned)
        self.overlap.warn = say
        if say is not None:
            say("zerorun: zero.overlap_optimizer: the host optimizer runs under the backward, unit by unit (the launch "
                "summary says what it hid and how often a step rolled it back)")
        return self.overlap

    @property
    def speculates(self) -> bool:
        """Whether the host updates the fused groups under the window's last backward (`speculate`)."""
        return self.overlap is not None

    def speculate(self, divisor: float) -> None:
        """The window's last backward starts: each fused unit is updated as its gradient is reduced, assuming the step
        divides by `divisor` (world x loss scale: no clipping); `apply` keeps it or rolls it back."""
        assert self.overlap is not None, "speculate only where the update overlaps the backward"
        self.overlap.begin(divisor)

    def wait_speculation(self) -> bool:
        """Wait for the host's updates made under the backward (their gradients are then free to change); whether
        there is a speculation to commit or roll back."""
        return self.overlap is not None and self.overlap.settle() is not None

    def apply(self, divisor: float, clamped: bool) -> None:
        """This window's update, gradients divided by `divisor` (world x loss scale / clip coefficient): the one made
        under the backward when it is this step (`clamped`: `clip_grad_value_` changed the gradients since)."""
        with self.ranges.named("optimizer"):
            why = self.overlap.mismatch(divisor, clamped) if self.wait_speculation() and self.overlap else None
            if self.overlap is not None and self.overlap.current is not None and why is None:
                self.overlap.commit()  # the update made under the backward is this step's (fused and owned)
                self._run(divisor, [g for g in range(len(self.groups)) if g not in self.fused],
                          owner=self.overlap.owned is None)
            else:
                self.settle(why or "read")
                self._run(divisor, list(range(len(self.groups))))

    def settle(self, reason: str = "read") -> None:
        """Roll back an update made under the backward that no step has claimed (its state as it was before);
        `reason`: why, a key of overlap.ROLLBACK_REASONS."""
        if self.overlap is not None and self.overlap.current is not None:
            self.overlap.rollback(reason)

    @torch.no_grad()
    def _run(self, divisor: float, groups: list[int], owner: bool = True) -> None:
        """Step `groups` (the owner way's too unless `owner` is False: the overlap committed it)."""
        with self.stepping():
            for g in groups:
                if self.groups[g].way is Way.OWNER or not any(piece.numel for piece in self.pieces[g]):
                    continue
                kernel = self.fused[g].kernel(divisor) if g in self.fused else self.elementwise[g].kernel(divisor)
                self.flat.run_pieces(g, self.pieces[g], kernel)
                if isinstance(kernel, TorchTiles):
                    self.elementwise[g].finished(kernel)
            self.flat.finish()
            if owner and self.owner is not None and any(self.groups[g].way is Way.OWNER for g in groups):
                self.owner.run(divisor)

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The engine calls the script's optimizers inside, on this thread (their guard lets these calls through)."""
        thread = threading.get_ident()
        self._stepping[thread] += 1  # each thread counts its own entries: one key per thread, no lock needed
        try:
            yield
        finally:
            self._stepping[thread] -= 1

    def is_stepping(self) -> bool:
        """Whether the engine is stepping a script's optimizer on this thread right now (optimizer_guard.py asks; so
        do the collectives' guards: the overlap's worker steps while the training thread reduces)."""
        return self._stepping[threading.get_ident()] > 0

    def steps_taken(self) -> int:
        """The updates the optimizers' state has seen (the largest `step` of its groups; 0 without one): a script
        that hands over, or loads, the optimizer of its own checkpoint resumes the engine's count from there, so
        that saves are tagged with the step the script counts."""
        counts = [self.fused[g].steps for g in self.fused]
        for g in self.elementwise:
            step = (self.elementwise[g].scalars or {}).get("step")
            counts.append(int(float(step)) if step is not None else 0)
        return max(counts, default=0)

    def ways(self) -> str | None:
        """One line saying how each optimizer runs (None when every group is zerorun's fused Adam: nothing new)."""
        if all(group.way is Way.FUSED_ADAM for group in self.groups):
            return None
        said = {Way.FUSED_ADAM: "zerorun's fused Adam over each rank's flat shard",
                Way.ELEMENTWISE: "over each rank's flat shard (elementwise)",
                Way.OWNER: "on whole parameters, each updated by the rank that owns it"}
        parts = dict.fromkeys(f"{type(g.optimizer).__name__} {said[g.way]}" for g in self.groups)
        balance = (f" (the busiest rank holds {self.owner.plan.imbalance:.2f}x the mean of the whole parameters and "
                   f"does {self.owner.work.imbalance:.2f}x the mean of their work)") if self.owner else ""
        return "zerorun: optimizer: " + "; ".join(parts) + balance + " (docs/optimizers.md)"

    # -- memory and telemetry --------------------------------------------------------------------
    def account(self, report: MemoryReport) -> None:
        self.flat.account(report)
        if self.owner is not None:
            self.owner.account(report)
            report.optimizer_imbalance = self.owner.plan.imbalance
        if self.overlap is not None:
            self.overlap.account(report)

    def stats(self) -> dict[str, dict[str, float]]:
        """Cumulative offload traffic of the flat ways (`FlatStep.stats`), and the overlap's (`OverlappedUpdate.stats`)."""
        return self.flat.stats() | (self.overlap.stats() if self.overlap is not None else {})

    # -- checkpoints ------------------------------------------------------------------------------
    def classes(self) -> list[str]:
        """Each param group's optimizer class name (a resume compares them)."""
        return [type(group.optimizer).__name__ for group in self.groups]

    def group_scalars(self, g: int) -> State | None:
        if g in self.fused:
            return self.fused[g].scalars
        if g in self.elementwise:
            return self.elementwise[g].scalars
        return None

    def flat_tensors(self) -> dict[str, torch.Tensor]:
        """Each flat group's state kinds to save (`<kind>.<group>`, laid out as the master; the master is the store's)."""
        return {flat_name(kind, g): self.store.home.state(g, kind)
                for g in range(len(self.groups)) for kind in self.store.home.kinds(g) if kind != MASTER}

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        """Each owned parameter's state tensors to save (`owned.<name>.<key>`, whole, on the host)."""
        out: dict[str, torch.Tensor] = {}
        if self.owner is None:
            return out
        for param in self.owner.owned:
            for key, value in self.owner.state_of(param).items():
                if isinstance(value, torch.Tensor):
                    out[f"owned.{param.name}.{key}"] = value.detach().to("cpu").contiguous()
        return out

    def describe(self, gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
        """The manifest's account of the optimizer state (JSON); `gather` collects a value from every rank (a
        collective: every rank calls this)."""
        mine = {} if self.owner is None else {p.name: owned_to_json(self.owner.state_of(p)) for p in self.owner.owned}
        shards = gather(mine)[:self.store.shard_world]  # stage 0: every rank owns everything; rank 0's file is saved
        owned = {name: {"rank": rank, "state": state} for rank, states in enumerate(shards) for name, state in states.items()}
        groups = [{"class": type(g.optimizer).__name__, "way": g.way.value, "kinds": list(g.kinds),
                   "scalars": scalars_to_json(self.group_scalars(i))} for i, g in enumerate(self.groups)]
        return {"groups": groups, "owned": owned}

    def load(self, saved: SavedState, groups: Collection[int] | None = None) -> None:
        """Restore every group's state (or only `groups`') from a checkpoint (any world size, stage or way it was
        saved at)."""
        for g, group in enumerate(self.groups):
            if group.way is not Way.OWNER and (groups is None or g in groups):
                self._load_flat(g, saved)
        if self.owner is not None:
            for param in self.owner.owned:
                if groups is None or param.group in groups:
                    self.owner.set_state(param, saved.whole(param.name, param.shape))

    def _load_flat(self, g: int, saved: SavedState) -> None:
        scalars = saved.scalars(g)
        if g in self.fused:
            self.fused[g].steps = int(float(scalars["step"])) if scalars else 0
        else:
            self.elementwise[g].scalars = scalars
        for kind in self.store.home.kinds(g)[1:]:
            values = torch.zeros(self.store.group_numels[g], dtype=torch.float32)  # padding stays zero
            for unit in units_of(self.store.units, g):
                for piece in unit.layout.shard_pieces(self.store.shard_rank):
                    name = self.names[unit.params[piece.index]]
                    got = saved.read(name, kind, piece.param_start, piece.param_start + piece.numel)
                    if got is not None:
                        at = unit.state_offset + piece.shard_start
                        values[at:at + piece.numel] = got
            self.store.home.write(g, kind, values)

    def _place_carried(self, comm: Collectives) -> None:
        """The state the script's optimizers held when handed over (take_over.py): flat kinds laid out like the
        master (rank 0's values, as for the parameters), owned parameters' state kept by their owner."""
        for g, group in enumerate(self.groups):
            if not group.carried:
                continue
            if group.way is Way.OWNER:
                assert self.owner is not None
                by_name = {self.names[p]: p for p in group.params}
                for param in self.owner.owned:
                    if param.group == g:
                        self.owner.set_state(param, group.carried[by_name[param.name]])
            else:
                self._place_flat(g, group, comm)
                if g in self.fused:
                    self.fused[g].steps = int(float((group.scalars or {}).get("step", 0)))
            group.carried = {}

    def _place_flat(self, g: int, group: EngineGroup, comm: Collectives) -> None:
        for unit in units_of(self.store.units, g):
            for kind in group.kinds:
                full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=self.store.device)
                for span, param in zip(unit.layout.spans, unit.params):
                    full[span.offset:span.end].copy_(group.carried[param][kind].reshape(-1))
                if comm.world_size > 1:
                    comm.broadcast(full, src=0).wait()
                self.store.home.write(g, kind, unit.piece(full, self.store.shard_rank), start=unit.state_offset)


def _owned_home(placement: Placement, device: torch.device) -> OwnedFiles | OwnedHost | None:
    """Where the owner way keeps its state between steps when not beside the parameters on the device they step
    on: files when the optimizer lives on NVMe, the host when it lives there and the device is a GPU (None: in the
    optimizer's own state)."""
    if placement.optimizer is Place.HOST and device.type != "cpu":
        return OwnedHost()
    if placement.optimizer is not Place.NVME:
        return None
    from zerorun.offload_files import rank_dir

    assert placement.optimizer_nvme is not None, "an optimizer on NVMe has a zero.offload_optimizer.nvme_path"
    return OwnedFiles(rank_dir(placement.optimizer_nvme, placement.run, placement.rank))


def offload_copies(transfers: Transfers, ranges: Ranges) -> Transfers:
    """`transfers` with each of its copies in an "offload copies" range (unchanged when nothing is offloaded)."""
    return transfers if isinstance(transfers, Direct) else OffloadCopies(transfers, ranges)


class OffloadCopies:
    """A `Transfers` that puts the optimizer's device/host copies in ranges, and delegates everything."""

    def __init__(self, inner: Transfers, ranges: Ranges) -> None:
        self.inner, self._ranges = inner, ranges

    def begin(self, grad_tiles: list[torch.Tensor], after: Any = None) -> None:
        with self._ranges.named("offload copies"):
            self.inner.begin(grad_tiles, after)

    def fetch(self, k: int) -> torch.Tensor:
        with self._ranges.named("offload copies"):
            return self.inner.fetch(k)

    def reaches(self, dest: torch.Tensor) -> bool:
        return self.inner.reaches(dest)

    def out_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.out_slot(numel, dtype)

    def send(self, dest: torch.Tensor, staged: torch.Tensor) -> None:
        with self._ranges.named("offload copies"):
            self.inner.send(dest, staged)

    def finish(self) -> None:
        with self._ranges.named("offload copies"):
            self.inner.finish()

    def held_bytes(self) -> int:
        return self.inner.held_bytes()

    def stats(self) -> dict[str, dict[str, float]]:
        return self.inner.stats()
