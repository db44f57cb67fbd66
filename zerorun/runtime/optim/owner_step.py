"""The owner way: the script's optimizer on whole parameters, each updated by the one rank that owns it.

Muon orthogonalizes a whole matrix, Adafactor factors its second moment into row and column sums,
LAMB scales a parameter's step by its norm: none of them can run over a flat piece that holds part of
a matrix (ways.py). Each such parameter is owned by one rank, which keeps its optimizer state and
updates it on its real shape, on the device wherever there is one (Newton-Schulz is matrix products,
what a GPU is for), whatever the placement keeps the state in. The
stage lays these groups out so that a rank's piece of each unit
holds exactly the parameters it owns, whole (`ownership.py`, `partition.whole_layout`), balanced by
the optimizer's cost. So the stage's own collectives do all the moving, as for Adam:

    the stage's reduce-scatter      -> this rank's gradient piece: its owned parameters' whole gradients
    this rank's master piece        -> its owned parameters, whole, on their real shapes
    each optimizer steps the parameters this rank owns (its object, its param groups)
    the master piece --> the stage's parameters (the same targets the flat way writes: flat_step.py)
    the stage's all-gather          -> every rank's parameters, whole matrices from their owners

No collective beyond the stage's own: the bytes on the wire are AdamW's but for the pieces' padding,
and each rank runs the optimizer only for what it owns. The state lives where the placement says: on
the device (in the optimizer's own `state`), on the host (`OwnedHost`: brought to the device for the
step and back after it; on a CPU-only machine it simply stays in the optimizer), or on NVMe
(`OwnedFiles`: a file per owned parameter, read before the step and written after).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from zerorun.runtime.memory import MemoryReport, tensor_bytes
from zerorun.runtime.offload.homes import MASTER
from zerorun.runtime.offload.transfers import Direct
from zerorun.runtime.optim.elementwise import stepping
from zerorun.runtime.optim.flat_step import Piece
from zerorun.runtime.optim.ways import whole_cost
from zerorun.runtime.ownership import OwnershipPlan
from zerorun.runtime.partition import ParamSpan
from zerorun.runtime.store import ParamStore

Stepper = Callable[[torch.optim.Optimizer, dict[int, list[torch.Tensor]]], None]  # steps one optimizer over these


def _step(optimizer: torch.optim.Optimizer, params: dict[int, list[torch.Tensor]]) -> None:
    """One `step()` of `optimizer` over `params` (its group index -> tensors) alone."""
    with stepping(optimizer, params):
        optimizer.step()


@dataclass(eq=False)
class OwnerParam:
    """A parameter of an owner-run group: where it lies in the flat layout, and who owns it."""

    name: str
    group: int  # the engine's param group
    unit: int  # index in the store's units
    span: ParamSpan  # its place in the unit
    shape: torch.Size
    owner: int
    key: nn.Parameter  # on its owner: the tensor its optimizer steps (its state is keyed by it); empty between steps


class OwnedFiles:
    """The owned parameters' optimizer state on NVMe: one file each, read before a step and written after it. The
    directory is this engine's own, made under `root` when it starts and removed when it is collected (an engine
    built after it at the same path has another)."""

    where = "nvme"

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="owned-", dir=root))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.root, True)

    def _file(self, param: OwnerParam) -> Path:
        return self.root / f"{param.name}.pt"

    def read(self, param: OwnerParam) -> dict[str, Any]:
        """The parameter's state ({} before its first step)."""
        file = self._file(param)
        return torch.load(file, weights_only=True) if file.is_file() else {}

    def write(self, param: OwnerParam, state: dict[str, Any]) -> None:
        if state:
            torch.save(state, self._file(param))
        else:
            self._file(param).unlink(missing_ok=True)

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.root.glob("*.pt"))


class OwnedHost:
    """The owned parameters' optimizer state in host memory, between the steps they take on the device: each
    tensor in a host buffer of its own (pinned where CUDA is, so it moves at the link's speed), reused."""

    where = "cpu"

    def __init__(self) -> None:
        self.states: dict[str, dict[str, Any]] = {}

    def read(self, param: OwnerParam) -> dict[str, Any]:
        """The parameter's state ({} before its first step), on the host."""
        return dict(self.states.get(param.name, {}))

    def write(self, param: OwnerParam, state: dict[str, Any]) -> None:
        if not state:
            self.states.pop(param.name, None)
            return
        kept = self.states.get(param.name, {})
        self.states[param.name] = {k: _to_host(v, kept.get(k)) for k, v in state.items()}

    def nbytes(self) -> int:
        return tensor_bytes([v for state in self.states.values() for v in state.values() if isinstance(v, torch.Tensor)])


def _to_host(value: Any, buffer: Any) -> Any:
    """`value` in host memory: copied into `buffer` where it fits (the last step's), else into a new pinned one."""
    if not isinstance(value, torch.Tensor) or value.device.type == "cpu":
        return value
    if not (isinstance(buffer, torch.Tensor) and buffer.shape == value.shape and buffer.dtype == value.dtype):
        buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=torch.cuda.is_available())
    return buffer.copy_(value)


class OwnerStep:
    """Steps the owner-run groups on the parameters this rank's pieces hold whole (see the module docstring)."""

    def __init__(self, groups: dict[int, tuple[torch.optim.Optimizer, int]], store: ParamStore,
                 pieces: list[list[Piece]], place: torch.device, tile_numel: int, names: dict[nn.Parameter, str],
                 kept: OwnedFiles | OwnedHost | None = None) -> None:
        """`groups`: engine group -> (its optimizer, the group's index there); `pieces`: per engine group, its
        units' gradients and targets in state order; `place`: where the owned parameters step (the device);
        `kept`: where their state stays between steps, when not with them (the host, or files on NVMe)."""
        self.groups, self.store, self.place = groups, store, place
        self.tile_numel, self.kept = tile_numel, kept
        self.piece_of: dict[int, Piece] = {}  # per unit index: its gradient piece and target
        self.params: list[OwnerParam] = []
        seen = {g: 0 for g in groups}  # each group's units so far: its pieces are in the same (state) order
        for k, unit in enumerate(store.units):
            if unit.group not in groups:
                continue
            self.piece_of[k] = pieces[unit.group][seen[unit.group]]
            seen[unit.group] += 1
            for i, span in enumerate(unit.layout.spans):
                owner = unit.layout.owner(i)
                if owner is None:  # an empty parameter: nothing to step, its rank is moot
                    assert not span.numel, f"{names[unit.params[i]]} straddles the pieces of an owner-run unit"
                    owner = min(span.offset // unit.shard_numel, store.shard_world - 1)
                self.params.append(OwnerParam(names[unit.params[i]], unit.group, k, span, unit.shapes[i], owner,
                                              nn.Parameter(torch.empty(0, device=place))))
        self.plan = OwnershipPlan.of([p.owner for p in self.params], [p.span.numel for p in self.params],
                                     store.shard_world)
        # the optimizer's work each rank does (Newton-Schulz's for a Muon), as the placement weighed it
        self.work = OwnershipPlan.of([p.owner for p in self.params],
                                     [whole_cost(groups[p.group][0])(p.shape) for p in self.params], store.shard_world)
        self.owned = [p for p in self.params if p.owner == store.shard_rank]
        self.direct = Direct(store.device)  # the targets are reached from device memory, as the flat way's are

    @property
    def units(self) -> list[int]:
        """The store's units that hold parameters this rank owns, in order."""
        return sorted({p.unit for p in self.owned})

    def owned_in(self, k: int) -> list[OwnerParam]:
        """The parameters of unit k this rank owns."""
        return [p for p in self.owned if p.unit == k]

    def optimizer_of(self, param: OwnerParam) -> torch.optim.Optimizer:
        return self.groups[param.group][0]

    def optimizers(self, params: list[OwnerParam] | None = None) -> dict[torch.optim.Optimizer,
                                                                          dict[int, list[OwnerParam]]]:
        """Per optimizer object, per param group index there, the parameters this rank owns (of `params`, if given)."""
        out: dict[torch.optim.Optimizer, dict[int, list[OwnerParam]]] = {}
        for param in self.owned if params is None else params:
            optimizer, index = self.groups[param.group]
            out.setdefault(optimizer, {}).setdefault(index, []).append(param)
        return out

    @torch.no_grad()
    def run(self, divisor: float, params: list[OwnerParam] | None = None, step: Stepper | None = None,
            grads_in_place: bool = True) -> None:
        """One step of the parameters this rank owns (`params` only, when given); gradients are divided by `divisor`
        (world x loss scale / clip). `step(optimizer, params by group index)` steps one optimizer (default: its
        `step()` over these parameters); `grads_in_place`: divide the reduced gradient pieces themselves (False
        under the backward: the step may yet be clipped or skipped, and the norm reads them)."""
        params = self.owned if params is None else params
        by_unit: dict[int, list[OwnerParam]] = {}
        for param in params:
            by_unit.setdefault(param.unit, []).append(param)
        masters = {k: self._take_whole(k, owned, divisor, grads_in_place) for k, owned in by_unit.items()}
        for optimizer, by_index in self.optimizers(params).items():
            owned = [p for group in by_index.values() for p in group]
            if self.kept is not None:  # the state comes in for the step, and goes back
                for param in owned:
                    self._put(optimizer, param, self._placed(self.kept.read(param)))
            (step or _step)(optimizer, {i: [p.key for p in group] for i, group in by_index.items()})
            if self.kept is not None:
                for param in owned:
                    self.kept.write(param, optimizer.state.pop(param.key, {}))
        for k, (master, in_home) in masters.items():
            self._send_back(k, by_unit[k], master, in_home)
        for param in params:
            param.key.data, param.key.grad = torch.empty(0, device=self.place), None

    def _span(self, param: OwnerParam) -> slice:
        """The parameter's elements within this rank's piece of its unit."""
        start = param.span.offset - self.store.shard_rank * self.store.units[param.unit].shard_numel
        return slice(start, start + param.span.numel)

    def _master(self, k: int) -> tuple[torch.Tensor, bool]:
        """Unit k's master piece, and whether it is the home's own memory (stepped in place: no copy in or out)."""
        unit = self.store.units[k]
        master = self.store.home.window(unit.group, MASTER, unit.state_offset, unit.shard_numel, self.store.device)
        if master is not None:
            return master, True
        master = torch.empty(unit.shard_numel, dtype=torch.float32, device=self.store.device)
        self.store.home.read(unit.group, MASTER, master, start=unit.state_offset)
        return master, False

    def _take_whole(self, k: int, owned: list[OwnerParam], divisor: float,
                    grads_in_place: bool) -> tuple[torch.Tensor, bool]:
        """Unit k's master piece (`_master`); the parameters `owned` of it take theirs and their gradients, whole."""
        master, in_home = self._master(k)
        grad = self.piece_of[k].grad
        for param in owned:
            span = self._span(param)
            # the master piece itself where the parameter steps there
            param.key.data = master[span].view(param.shape).to(self.place)
            # divided in the reduced piece itself where it is already an fp32 tensor here: nothing reads the piece
            # after the step but the reducer, which zeroes it (a copy cost a pass and fresh pages each step)
            whole = grad[span].view(param.shape).to(self.place, torch.float32)
            param.key.grad = whole.div_(divisor) if grads_in_place else whole.div(divisor)
        return master, in_home

    def _send_back(self, k: int, owned: list[OwnerParam], master: torch.Tensor, in_home: bool) -> None:
        """Unit k's master piece from the parameters `owned` of it, then the stage's parameters from it."""
        for param in owned:
            values = master[self._span(param)]
            if param.key.data_ptr() != values.data_ptr():  # stepped elsewhere (the host's copy)
                values.copy_(param.key.detach().view(-1))
        if not in_home:
            unit = self.store.units[k]
            self.store.home.write(unit.group, MASTER, master, start=unit.state_offset)
        self._deliver(k, master)

    def _deliver(self, k: int, master: torch.Tensor) -> None:
        """The stage's parameters of unit k (this rank's piece) from its master piece."""
        unit = self.store.units[k]
        target = self.piece_of[k].target
        for lo in range(0, unit.shard_numel, self.tile_numel):
            hi = min(unit.shard_numel, lo + self.tile_numel)
            out = target.staging(self.direct, lo, hi)
            if out is not None:
                out.copy_(master[lo:hi])
                target.deliver(self.direct, lo, hi, out)
        self.direct.finish()

    # -- a speculation's backup (owner_overlap.py) ---------------------------------------------------
    def master_values(self, param: OwnerParam, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the owned parameter's master values (flat), in `out` if given (else new, in host memory): its
        own range of the home, not its unit's piece (which a host home seen from a GPU would copy whole)."""
        out = torch.empty(param.span.numel, dtype=torch.float32) if out is None else out
        unit = self.store.units[param.unit]
        self.store.home.read(unit.group, MASTER, out, start=unit.state_offset + self._span(param).start)
        return out

    def restore(self, k: int, values: dict[OwnerParam, torch.Tensor]) -> None:
        """Unit k's owned parameters' master values from `values` (flat), then the stage's parameters from them."""
        master, in_home = self._master(k)
        for param, saved in values.items():
            master[self._span(param)].copy_(saved)
        if not in_home:
            unit = self.store.units[k]
            self.store.home.write(unit.group, MASTER, master, start=unit.state_offset)
        self._deliver(k, master)

    # -- state: memory, checkpoints ------------------------------------------------------------------
    def state_of(self, param: OwnerParam) -> dict[str, Any]:
        """The optimizer state this rank keeps for an owned parameter ({} before its first step)."""
        if self.kept is not None:
            return self.kept.read(param)
        optimizer, _ = self.groups[param.group]
        return dict(optimizer.state.get(param.key, {}))

    def set_state(self, param: OwnerParam, state: dict[str, Any]) -> None:
        """Replace an owned parameter's optimizer state (a checkpoint load, or the state handed over with it)."""
        state = self._placed(state)
        if self.kept is not None:
            self.kept.write(param, state)
        else:
            self._put(self.groups[param.group][0], param, state)

    def _placed(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` where its parameter steps; 0-d tensors (a `step`) stay where they are: torch's optimizers keep
        them on the host unless capturable."""
        return {k: v.to(self.place, non_blocking=True) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in state.items()}

    @staticmethod
    def _put(optimizer: torch.optim.Optimizer, param: OwnerParam, state: dict[str, Any]) -> None:
        optimizer.state.pop(param.key, None)
        if state:
            optimizer.state[param.key] = state

    def account(self, report: MemoryReport) -> None:
        if self.kept is not None:
            report.add("optimizer", self.kept.where, self.kept.nbytes())
            report.add("comm", self.store.device.type, self.direct.held_bytes())
            return
        tensors = [v for param in self.owned for v in self.state_of(param).values() if isinstance(v, torch.Tensor)]
        report.add("optimizer", self.place.type, tensor_bytes(tensors))
        report.add("comm", self.store.device.type, self.direct.held_bytes())
