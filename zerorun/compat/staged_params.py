"""Parameters `deepspeed.zero.Init` made, between the `with` block and `deepspeed.initialize`.

transformers loads a pretrained model at stage 3 before any engine exists: it builds the model
inside `zero.Init` (zerorun: `sharded_init`, meta parameters and a log of their initialisation),
then writes the weights inside `zero.GatheredParameters(params, modifier_rank=0)` blocks, module by
module. No rank may hold the whole model meanwhile, so each parameter lives here as this rank's
piece of its flat values (`Piece`: elements [r*n, (r+1)*n) of the padded flat, n = ceil(numel / world)):

- the first block replays the `Init` log once, keeping only this rank's piece of each parameter as
  it is finalised (one parameter whole at a time);
- a block all-gathers its parameters' pieces into full tensors, swaps them into the parameters
  (which stay the same objects), and on exit broadcasts `modifier_rank`'s values, keeps this rank's
  piece of them and swaps the meta tensors back; outside a block a parameter stays a meta tensor,
  so a write to it changes nothing, as a write to a partitioned parameter in DeepSpeed;
- the log then ends with one op per parameter that all-gathers its pieces: the engine's replay of
  the log (every rank, same order) builds its shards from the loaded values.

`peak_bytes()` is the most parameter memory this rank held here: its pieces plus the block's full
tensors (and, while staging, the one parameter being finalised).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.runtime import context
from zerorun.runtime.comm.wire import CARRIES, Primitive
from zerorun.runtime.stage3 import sharded_init


@dataclass
class Piece:
    """This rank's part of one parameter's flat values."""

    values: torch.Tensor  # n elements (the last rank's padded)
    shape: torch.Size

    @staticmethod
    def of(full: torch.Tensor) -> Piece:
        rank, world = _rank_world()
        n = math.ceil(full.numel() / world)
        values = torch.zeros(n, dtype=full.dtype, device=full.device)
        own = full.detach().reshape(-1)[rank * n:(rank + 1) * n]
        values[:own.numel()].copy_(own)
        return Piece(values, full.shape)

    def keep(self, full: torch.Tensor) -> None:
        self.values.copy_(Piece.of(full).values)

    def assemble(self) -> torch.Tensor:
        """The full tensor (a collective: every rank calls it for the same parameter)."""
        _, world = _rank_world()
        if world == 1:
            return self.values[:self.shape.numel()].clone().view(self.shape)
        wire = _wire_device(self.values.device, Primitive.ALL_GATHER_INTO_TENSOR)
        out = torch.empty(self.values.numel() * world, dtype=self.values.dtype, device=wire)
        dist.all_gather_into_tensor(out, self.values.to(wire))
        return out[:self.shape.numel()].view(self.shape).to(self.values.device)


def _wire_device(device: torch.device, primitive: Primitive) -> torch.device:
    """Where the process group's backend takes `primitive` of tensors on `device`: that device, or this rank's GPU
    for host tensors on NCCL, which carries device memory only (wire.py). A model built on the host inside
    `zero.Init` keeps its pieces there; only the collective's copy visits the GPU."""
    carried = CARRIES.get(dist.get_backend(), {}).get(primitive)
    if carried is None or device.type in carried:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _assemble_into(target: torch.Tensor, piece: Piece) -> None:
    """The log's last op for a staged parameter (replayed by the engine)."""
    target.copy_(piece.assemble())


_PIECES: dict[int, dict[Any, Piece]] = {}  # id(InitLog) -> {parameter: piece}; logs live on in sharded_init
_held = 0
_peak = 0


def peak_bytes() -> int:
    return _peak


def _account(extra: int) -> None:
    global _peak
    _peak = max(_peak, _held + extra)


def _pieces(params: list[torch.Tensor]) -> dict[Any, Piece]:
    """Each parameter's piece, staging (once) the `Init` logs that made them."""
    global _held
    logs = context.current().part(sharded_init.InitLogs).owning(params)
    for log in logs:
        if id(log) in _PIECES:
            continue
        staged: dict[Any, Piece] = {}

        def keep(param: Any, full: torch.Tensor) -> None:
            global _held
            _account(full.numel() * full.element_size())
            staged[param] = Piece.of(full)
            _held += staged[param].values.numel() * full.element_size()

        log.replay(keep)
        _PIECES[id(log)] = staged
        for param, piece in staged.items():  # the log now ends with the staged values
            log.ops.append(sharded_init.RecordedOp(param, "copy_", _assemble_into, (piece,), {}))
    found = {p: piece for log in logs for p, piece in _PIECES[id(log)].items()}
    stray = [p for p in params if p not in found]
    if stray:
        raise ZerorunError(
            f"deepspeed.zero.GatheredParameters: a parameter of shape {tuple(stray[0].shape)} is a meta tensor that "
            "no finished zero.Init block made, so it has no values: gather a zero.Init model's parameters after its "
            "`with` block. Before deepspeed.initialize zerorun keeps stage 3 parameters as meta tensors, and a module "
            "built on their device is meta too: transformers' resize_token_embeddings at stage 3 builds its new "
            "embedding so, which zerorun cannot serve; resize in a plain process and save_pretrained first.")
    return found


@contextlib.contextmanager
def gathered(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    """`params` (meta, from `Init`) whole inside the block; `modifier_rank`'s values kept on exit."""
    pieces = _pieces(params)
    order = {p: i for i, p in enumerate(pieces)}  # creation order, the same on every rank (callers' may not be)
    params = sorted(params, key=order.__getitem__)
    _account(sum(p.numel() * p.element_size() for p in params))
    for param in params:
        _swap(param, torch.nn.Parameter(pieces[param].assemble(), requires_grad=param.requires_grad))
    try:
        yield
    finally:
        for param in params:
            value = param.data
            if modifier_rank is not None:
                if _rank_world()[1] > 1:
                    carried = value.to(_wire_device(value.device, Primitive.BROADCAST))
                    dist.broadcast(carried, src=modifier_rank)
                    value = carried.to(value.device)
                pieces[param].keep(value)
            _swap(param, torch.nn.Parameter(torch.empty_like(value, device="meta"), requires_grad=param.requires_grad))


def _swap(param: torch.Tensor, other: torch.Tensor) -> None:
    """Give `param` the contents of `other`, keeping its Python attributes (transformers' `_is_hf_initialized`)."""
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, other)
    param.__dict__.update(attributes)
