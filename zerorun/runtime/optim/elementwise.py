"""The elementwise way: the script's own optimizer updates this rank's flat shard, tile by tile.

An elementwise optimizer (SGD, RMSprop, Lion, ...: ways.py) computes each element's update from
that element's gradient and state alone, so a flat run of elements from several parameters is, to
it, one parameter. Each tile of the shard (flat_step.py) is handed to the script's optimizer object
itself as a one-element param group: a parameter viewing the tile's master, its `grad` the tile's
averaged gradient, and `optimizer.state` for it made of views of the tile's state kinds in the home
(device, host or NVMe staging), so the optimizer updates the home in place:

    optimizer.param_groups[i]["params"] = [tile]      # only while zerorun steps it
    optimizer.state[tile] = {"momentum_buffer": <home view>, "step": <the group's scalar>}
    optimizer.step()

The optimizer's state has two parts: *kinds*, tensors shaped like the parameter (kept per element in
the home, so they are sharded and offloaded with the master), and *scalars*, 0-d tensors or numbers
such as `step` (one value per param group, the same for every tile). Before the group's first step
its state is absent, as torch's optimizers expect (SGD's first momentum is the gradient itself): the
tiles get an empty state and what the optimizer makes is copied into the home. Which kinds a group
has is learnt before any memory is laid out, from the state the optimizer already holds (Adagrad
makes its `sum` when built) or from one step on a two-element probe (`probe_kinds`). A state entry
shaped otherwise than its parameter is not elementwise and is refused, naming it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from zerorun.errors import ZerorunError
from zerorun.runtime.offload.homes import MASTER

State = dict[str, Any]


@contextmanager
def stepping(optimizer: torch.optim.Optimizer, params: dict[int, list[torch.Tensor]]) -> Iterator[None]:
    """The optimizer's param groups hold `params` (group index -> tensors; no others) while the block runs."""
    saved = [group["params"] for group in optimizer.param_groups]
    for i, group in enumerate(optimizer.param_groups):
        group["params"] = params.get(i, [])
    try:
        yield
    finally:
        for group, own in zip(optimizer.param_groups, saved):
            group["params"] = own


def split_state(state: State, param: torch.Tensor, where: str) -> tuple[dict[str, torch.Tensor], State]:
    """(kinds, scalars) of one parameter's state; an entry that is neither is refused (`where` names the group)."""
    kinds, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.shape != param.shape or value.dtype != torch.float32:
                raise ZerorunError(f"{where}: its state {key!r} is {value.dtype} {tuple(value.shape)} for a parameter "
                                   f"{tuple(param.shape)}: not elementwise (zerorun keeps an elementwise optimizer's "
                                   "state per element, in fp32). Remove the zerorun.Elementwise declaration: the "
                                   "optimizer then runs on whole parameters.")
            kinds[key] = value
        else:
            scalars[key] = value
    return kinds, scalars


def copied(scalars: State) -> State:
    """A tile's own copy of the group's scalars (tensors cloned: an optimizer increments `step` in place)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}


def probe_kinds(optimizer: torch.optim.Optimizer, index: int, device: torch.device, where: str) -> tuple[str, ...]:
    """The state kinds one step of param group `index` makes, from a step on a two-element probe parameter with a
    zero gradient (the optimizer's own object, its groups swapped for the probe while it steps)."""
    probe = nn.Parameter(torch.zeros(2, device=device))
    probe.grad = torch.zeros(2, device=device)
    with stepping(optimizer, {index: [probe]}):
        optimizer.step()
    kinds, _ = split_state(optimizer.state.pop(probe, {}), probe, where)
    return tuple(kinds)


class ElementwiseGroup:
    """One param group run the elementwise way: its optimizer, its state kinds, and its scalars between steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, kinds: tuple[str, ...],
                 scalars: State | None, where: str) -> None:
        """`scalars`: the group's scalars (None: the optimizer has not stepped it; its state is absent)."""
        self.optimizer, self.index, self.kinds, self.where = optimizer, index, kinds, where
        self.scalars = scalars

    def kernel(self, divisor: float) -> TorchTiles:
        """The `TileKernel` of one step; `finished(kernel)` after its last tile."""
        return TorchTiles(self, divisor)

    def finished(self, kernel: TorchTiles) -> None:
        """A step ended: every tile left the same scalars (one per group); keep them."""
        if kernel.scalars is not None:
            self.scalars = kernel.scalars


class TorchTiles:
    """The script's optimizer as a `TileKernel` (flat_step.py) for one step of one group."""

    def __init__(self, group: ElementwiseGroup, divisor: float) -> None:
        self.group, self.divisor = group, divisor
        self.scalars: State | None = None  # what the tiles left

    def update(self, views: dict[str, torch.Tensor], grad: torch.Tensor, lowp_out: torch.Tensor | None) -> bool:
        group = self.group
        tile = nn.Parameter(views[MASTER])  # the same memory: the optimizer updates the home in place
        tile.grad = grad.to(torch.float32) / self.divisor
        absent = group.scalars is None
        opt = group.optimizer
        opt.state[tile] = {} if absent else {**{k: views[k] for k in group.kinds}, **copied(group.scalars or {})}
        with stepping(opt, {group.index: [tile]}):
            opt.step()
        kinds, self.scalars = split_state(opt.state.pop(tile, {}), tile, group.where)
        if set(kinds) != set(group.kinds):
            raise ZerorunError(f"{group.where}: its state per element was {sorted(group.kinds)} when zerorun laid it "
                               f"out and is {sorted(kinds)} now (a hyper-parameter changed what it keeps?); "
                               "zerorun lays the state out once, at zerorun.initialize.")
        for key, value in kinds.items():
            if value.data_ptr() != views[key].data_ptr():  # made at the first step, or replaced, not updated in place
                views[key].copy_(value)
        if tile.data_ptr() != views[MASTER].data_ptr():  # `p.data = ...` rather than an in-place update
            views[MASTER].copy_(tile.detach())
        return False
