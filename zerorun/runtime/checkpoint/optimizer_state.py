"""A checkpoint's optimizer state, read back for any world size, stage and way (optim/update.py's `SavedState`).

A rank file holds two forms of optimizer state (optim/ways.py):
- *flat*: per param group and kind, `<kind>.<group>`: this rank's pieces of every parameter, laid out
  like the master (the manifest's `params[name].pieces` say where each piece of each parameter lies);
- *owned*: per parameter run the owner way, its whole state, `owned.<name>.<key>`, in its owner's
  file (the manifest's `optimizer.owned[name]` says which rank and what each entry is).

Either form answers both questions a resume asks, whatever form the new run keeps: the elements
[lo, hi) of one parameter's state kind (`read`, for a flat group) and one parameter's whole state
(`whole`, for its new owner). So a state saved on 3 ranks at stage 2 loads on 2 ranks at stage 3, and
a state saved flat loads for an owner and back. A checkpoint of zerorun before this (manifest
version 2) holds Adam's state only and reads as the flat form with Adam's kinds.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zerorun.runtime.checkpoint.files import Checkpoint
from zerorun.runtime.checkpoint.manifest import optimizer_groups, shard_file
from zerorun.runtime.optim.state_json import State, is_tensor_entry, scalar_from_json, scalars_from_json


class SavedOptimizerState(contextlib.ExitStack):
    """The optimizer state of checkpoint `ckpt` (a context manager: the rank files it opens stay open inside)."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__()
        self.ckpt, self.manifest = ckpt, ckpt.manifest
        self.groups = optimizer_groups(self.manifest)
        self.owned: dict[str, dict[str, Any]] = self.manifest["optimizer"].get("owned", {})
        self._files: dict[int, Any] = {}

    def _file(self, rank: int) -> Any:
        if rank not in self._files:
            self._files[rank] = self.enter_context(self.ckpt.reading(shard_file(rank)))
        return self._files[rank]

    def scalars(self, group: int) -> State | None:
        saved = self.groups[group]
        if saved["way"] != "owner":
            return scalars_from_json(saved["scalars"])
        first = next((name for name, entry in self.manifest["params"].items() if entry["group"] == group
                      and name in self.owned), None)  # an owner-run group: any of its parameters' scalars
        if first is None:
            return None
        entries = self.owned[first]["state"]
        if not entries:  # it had not stepped
            return None
        return {key: scalar_from_json(entry) for key, entry in entries.items() if not is_tensor_entry(entry)}

    def read(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        owned = self.owned.get(name)
        if owned is not None:
            entry = owned["state"].get(kind)
            if entry is None or not is_tensor_entry(entry):
                return None
            whole: torch.Tensor = self._file(owned["rank"]).get_slice(f"owned.{name}.{kind}")[:]
            return whole.reshape(-1)[lo:hi].float()
        param = self.manifest["params"][name]
        group = param["group"]
        if kind not in self.groups[group]["kinds"]:
            return None
        out = torch.zeros(hi - lo, dtype=torch.float32)
        for rank, offset, first, numel in param["pieces"]:
            a, b = max(lo, first), min(hi, first + numel)
            if a < b:
                source = self.ckpt.slice_of(self._file(rank), rank, f"{kind}.{group}")
                out[a - lo:b - lo] = source[offset + a - first:offset + b - first]
        return out

    def whole(self, name: str, shape: torch.Size) -> State:
        owned = self.owned.get(name)
        if owned is not None:
            return {key: self._file(owned["rank"]).get_tensor(f"owned.{name}.{key}") if is_tensor_entry(entry)
                    else scalar_from_json(entry) for key, entry in owned["state"].items()}
        group = self.manifest["params"][name]["group"]
        scalars = self.scalars(group)
        if scalars is None:  # the group had not stepped: no state
            return {}
        numel = 1
        for size in shape:
            numel *= size
        state: State = {kind: self.read(name, kind, 0, numel) for kind in self.groups[group]["kinds"]}
        state = {kind: t.reshape(shape) for kind, t in state.items() if t is not None}
        return {**state, **scalars}
