"""`optimizer.state_dict()` and `load_state_dict()` after `zerorun.initialize`: the whole state, in torch's format.

A DDP script keeps its optimizer in its own checkpoint (`{'model': ..., 'optimizer': optimizer.state_dict(),
'iter_num': ...}`, `torch.save` on rank 0) and, to resume, loads it into the optimizer before wrapping the model.
Under zerorun the state is sharded across ranks (and may live on the host or NVMe), so the engine's optimizer
and every optimizer the script handed over answer these two calls here:

- `state_dict()` gathers every parameter's state onto every rank, in torch's own layout (`state` keyed by the
  parameter's index over the param groups, `param_groups` with `params` as those indices), so the file is the
  one DDP would write: a DDP run, a zerorun run at any stage or world size, or the optimizer built before
  `zerorun.initialize` (which takes over the state it holds) load it alike. Every rank calls it: the gathers are
  collectives, placed as `state_dict` so a call on rank 0 alone is stopped with the message saying so.
- `load_state_dict(sd)` (every rank, with the same `sd`) sets the hyper-parameters of each group and reads
  each parameter's state back into whatever this rank keeps of it (update.py's `load`, as from a checkpoint).

The gather holds one unit's state at a time beside the dict it builds; the dict itself is the whole optimizer
state in fp32 on every rank's host (8 bytes per parameter for Adam). For a model whose state does not fit
there, `engine.save_checkpoint` (sharded, written in the background) is the way.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from zerorun.errors import ZerorunError
from zerorun.runtime.checkpoint.sharded import gather_json
from zerorun.runtime.comm.collectives import Collectives
from zerorun.runtime.engine_place import Activity, EnginePlace
from zerorun.runtime.in_flight import InFlight, Need
from zerorun.runtime.optim.state_json import State, is_tensor_entry, scalar_from_json
from zerorun.runtime.optim.update import Update
from zerorun.runtime.store import ParamStore

StateDict = dict[str, Any]


class Engine(Protocol):
    store: ParamStore
    update: Update
    comm: Collectives
    device: torch.device
    where: EnginePlace
    in_flight: InFlight
    checkpoints: Any  # before_update(): a background save has captured the state a load replaces
    global_step: int


def _packed_groups(optimizer: torch.optim.Optimizer) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """`optimizer`'s param groups as torch's `state_dict` packs them, and each parameter's index (by id)."""
    index: dict[int, int] = {}
    groups, start = [], 0
    for group in optimizer.param_groups:
        index.update({id(p): i for i, p in enumerate(group["params"], start) if id(p) not in index})
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [index[id(p)] for p in group["params"]]
        start += len(packed["params"])
        groups.append(packed)
    return groups, index


def _groups_of(engine: Engine, optimizer: torch.optim.Optimizer) -> list[int]:
    """The engine's groups (update.groups' indices) that are param groups of `optimizer`."""
    mine = {id(group) for group in optimizer.param_groups}
    return [g for g, group in enumerate(engine.update.groups) if id(group.hyper) in mine]


def state_dict(engine: Engine, optimizer: torch.optim.Optimizer) -> StateDict:
    """`optimizer`'s whole state in torch's format, on every rank (a collective: every rank calls it)."""
    engine.in_flight.settle(Need.STATE)
    with engine.where.doing(Activity.STATE_DICT):
        return _gather(engine, optimizer)


def _gather(engine: Engine, optimizer: torch.optim.Optimizer) -> StateDict:
    store, update, comm = engine.store, engine.update, engine.comm
    groups, index = _packed_groups(optimizer)
    described = update.describe(lambda value: gather_json(comm, engine.device, value))
    holds = comm.rank < store.shard_world  # stage 0: one copy of the state, rank 0's
    flat = update.flat_tensors() if holds else {}
    owned_here = update.owned_tensors() if holds else {}
    state: dict[int, State] = {}
    for g in _groups_of(engine, optimizer):
        saved = described["groups"][g]
        scalars = {key: scalar_from_json(entry) for key, entry in (saved["scalars"] or {}).items()}
        for unit in (u for u in store.units if u.group == g):
            if saved["way"] == "owner":
                for param in unit.params:
                    entry = described["owned"].get(update.names[param])
                    if entry is not None and entry["state"]:
                        state[index[id(param)]] = _owned(engine, update.names[param], entry, owned_here)
                continue
            if saved["scalars"] is None:  # the group has not stepped: torch keeps no state for it either
                continue
            kinds = {kind: _unit_kind(engine, unit, flat.get(f"{kind}.{g}")) for kind in saved["kinds"]}
            for span, param, shape in zip(unit.layout.spans, unit.params, unit.shapes):
                state[index[id(param)]] = {**{kind: full[span.offset:span.end].reshape(shape).clone()
                                              for kind, full in kinds.items()},
                                           **{key: value.clone() if isinstance(value, torch.Tensor) else value
                                              for key, value in scalars.items()}}
    return {"state": state, "param_groups": groups}


def _unit_kind(engine: Engine, unit: Any, flat: torch.Tensor | None) -> torch.Tensor:
    """One state kind of one unit, whole, on every rank: each rank's piece, summed over the ranks."""
    full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=engine.device)
    if flat is not None:
        unit.piece(full, engine.store.shard_rank).copy_(unit.state_slice(flat))
    if engine.comm.world_size > 1:
        engine.comm.all_reduce(full, async_op=False).wait()
    return full.cpu()


def _owned(engine: Engine, name: str, entry: dict[str, Any], here: dict[str, torch.Tensor]) -> State:
    """An owned parameter's state (its owner keeps it whole), on every rank."""
    out: State = {}
    for key, described in entry["state"].items():
        if not is_tensor_entry(described):
            out[key] = scalar_from_json(described)
            continue
        dtype = getattr(torch, described["tensor"])
        value = torch.zeros(described["shape"], dtype=dtype, device=engine.device)
        if engine.comm.rank == entry["rank"]:
            value.copy_(here[f"owned.{name}.{key}"])
        if engine.comm.world_size > 1:
            engine.comm.all_reduce(value, async_op=False).wait()  # zeros elsewhere: the owner's values
        out[key] = value.cpu()
    return out


# -- load -----------------------------------------------------------------------------------------
class _FromTorch:
    """A torch-format optimizer state dict as the update reads a checkpoint back (update.py's `SavedState`)."""

    def __init__(self, engine: Engine, state: dict[Any, State], index: dict[str, int], groups: list[int]) -> None:
        self.engine, self.state, self.index = engine, state, index
        self.params = {g: [p for u in engine.store.units if u.group == g for p in u.params] for g in groups}

    def _of(self, name: str) -> State:
        at = self.index.get(name)
        return {} if at is None else dict(self.state.get(at, self.state.get(str(at), {})))

    def scalars(self, group: int) -> State | None:
        """The group's one value of each entry that is not per element (`step`), from its first parameter with
        state (zerorun steps a group's parameters alike); None: none has state."""
        for param in self.params.get(group, []):
            held = self._of(self.engine.update.names[param])
            if held:
                return {k: v for k, v in held.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
        return None

    def read(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        value = self._of(name).get(kind)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return None
        return value.detach().reshape(-1)[lo:hi].to("cpu", torch.float32)

    def whole(self, name: str, shape: torch.Size) -> State:
        """Copies: training must not change the dict the script loaded from."""
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in self._of(name).items()}


def load_state_dict(engine: Engine, optimizer: torch.optim.Optimizer, sd: StateDict) -> None:
    """Set `optimizer`'s hyper-parameters and state from `sd` (torch's format; every rank calls it, with the same)."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ZerorunError("optimizer.load_state_dict: expected a dict with 'state' and 'param_groups', as "
                           "optimizer.state_dict() returns (under DDP or zerorun).")
    groups, index = _packed_groups(optimizer)
    saved_groups = sd["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise ZerorunError(f"optimizer.load_state_dict: the saved param groups hold "
                           f"{[len(g['params']) for g in saved_groups]} parameters, this optimizer's "
                           f"{[len(g['params']) for g in groups]}: it was saved for another model or grouping.")
    engine.in_flight.settle(Need.PARAMETERS)  # loading writes the pieces an unfinished publish may still send
    engine.checkpoints.before_update()
    by_name = {engine.update.names[p]: index[id(p)] for u in engine.store.units for p in u.params if id(p) in index}
    saved_index = _renumber(by_name, groups, saved_groups)
    with engine.where.doing(Activity.STATE_DICT):
        mine = _groups_of(engine, optimizer)  # the engine's other optimizers keep their state
        engine.update.load(_FromTorch(engine, sd["state"], saved_index, mine), mine)
    for live, saved in zip(optimizer.param_groups, saved_groups):
        live.update({k: v for k, v in saved.items() if k != "params"})
    if engine.global_step == 0:  # the script's own checkpoint: count on from the updates it had made
        engine.global_step = engine.update.steps_taken()


def _renumber(by_name: dict[str, int], groups: list[dict[str, Any]], saved: list[dict[str, Any]]) -> dict[str, int]:
    """Each parameter's index in the saved dict: the one at its position in the saved groups (torch pairs them
    by position too)."""
    position = {i: (g, k) for g, group in enumerate(groups) for k, i in enumerate(group["params"])}
    return {name: saved[g]["params"][k] for name, i in by_name.items() for g, k in [position[i]]}

