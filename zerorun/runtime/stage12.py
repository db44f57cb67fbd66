"""Gradient handling for stages 0, 1 and 2: collect, accumulate, reduce across ranks.

A post-accumulate-grad hook on every trainable parameter moves the fresh gradient out of
`param.grad` into an fp32 flat buffer laid out like the parameters (`FlatParams` units), then
frees it. When all parameters of a unit have reported, the unit's gradients are reduced
asynchronously while backward continues (`overlap_comm`).

| stage | what a rank keeps                    | when it communicates           | collective per unit       |
|-------|--------------------------------------|--------------------------------|---------------------------|
| 0     | full gradients                       | last micro-step of a step       | all-reduce                |
| 1     | full gradients (uses its own pieces) | last micro-step of a step       | reduce-scatter, in place  |
| 2     | only its gradient shard              | every micro-step                | reduce-scatter into shard |

Stage 2 copies each unit's gradients into a pooled staging buffer that lives only until the
unit's reduce-scatter finishes, so no full-size gradient buffer exists.

Units are launched strictly in layout order (a unit that is ready waits for the ones before it)
so every rank issues the same collectives in the same order even if hooks fire in a different
order; units whose parameters got no gradient (an unused branch) are reduced at the end of
backward, with zeros. Gradients are *summed* across ranks; the optimizer divides by the world
size in the same pass that unscales and clips (`Engine._optimizer_step`).
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable

import torch
from torch import nn

from zerorun.errors import ZerorunError
from zerorun.runtime.collectives import Handle
from zerorun.runtime.flat import FlatParams, Unit


MAX_INFLIGHT = 2  # unit reductions in flight at once; beyond that the oldest is finished first


class BufferPool:
    """Reusable zeroed buffers by size, so stage 2 does not allocate on every micro-step."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.allocated_bytes = 0

    def get(self, numel: int) -> torch.Tensor:
        """A buffer of `numel` elements with undefined contents (the caller writes or zeroes every element)."""
        if self._free[numel]:
            return self._free[numel].pop()
        self.allocated_bytes += numel * torch.empty((), dtype=self.dtype).element_size()
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def put(self, buffer: torch.Tensor) -> None:
        self._free[buffer.numel()].append(buffer)


class GradReducer:
    """Receives gradients from backward hooks and leaves this rank's reduced pieces ready to step."""

    def __init__(self, flat: FlatParams, stage: int, overlap: bool, ordered: bool = True,
                 on_launch: Callable[[int], None] | None = None) -> None:
        """`ordered=False` launches each unit as soon as it is complete (stage 3: backward's own
        order, the same on every rank for the same graph) instead of strictly in layout order;
        `on_launch(k)` is told when unit k's gradients have gone out (stage 3 frees its parameters)."""
        assert stage in (0, 1, 2), f"GradReducer handles stages 0-2, got {stage}"
        self.flat = flat
        self.ordered = ordered
        self.on_launch = on_launch
        self.comm = flat.comm
        self.stage = stage
        self.overlap = overlap
        dtype, device = flat.policy.reduce_dtype, flat.device
        total = sum(u.padded_numel for u in flat.units)
        # stage 0/1: full gradients; stage 2: the rank's shard only (per group, like the master)
        self.full_grads = torch.zeros(total, dtype=dtype, device=device) if stage < 2 else None
        self.grad_shards = ([torch.zeros(n, dtype=dtype, device=device) for n in flat.group_numels]
                            if stage == 2 else None)
        self.pool = BufferPool(dtype, device)
        self._place = {param: (k, i) for k, unit in enumerate(flat.units) for i, param in enumerate(unit.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._place]
        self._reset_backward_state(reduce=False)
        self._in_backward = False
        self.overlapped_launches = 0  # units whose reduction started while backward was still running

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        """Called by the engine before `loss.backward()`; `reduce` is False on accumulation-only micro-steps."""
        self._reset_backward_state(reduce or self.stage == 2)
        self._in_backward = True

    def _reset_backward_state(self, reduce: bool) -> None:
        self._reduce = reduce
        self._seen: list[set[int]] = [set() for _ in self.flat.units]
        self._staging: dict[int, torch.Tensor] = {}
        self._inflight: deque[tuple[int, Handle]] = deque()
        self._next_launch = 0
        self._launched: set[int] = set()

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self._in_backward:
            raise ZerorunError("a gradient arrived outside engine.backward(loss): call engine.backward(loss), "
                               "not loss.backward(), so zerorun can reduce gradients across ranks.")
        k, index = self._place[param]
        unit = self.flat.units[k]
        grad, param.grad = param.grad, None
        if k in self._launched:
            raise ZerorunError(
                f"parameter {tuple(param.shape)} received a second gradient after its bucket was reduced "
                "(a parameter used in two re-entrant checkpoint regions?); set zero.overlap_comm: false.")
        span = unit.layout.spans[index]
        region = self._grad_region(k, unit)[span.offset:span.end]
        if self.full_grads is None and index not in self._seen[k]:
            region.copy_(grad.view(-1))  # a fresh staging buffer: the first gradient overwrites
        else:
            region.add_(grad.view(-1))
        self._seen[k].add(index)
        if self.overlap and self._reduce:
            launched = len(self._launched)
            if self.ordered:
                self._launch_ready()
            elif len(self._seen[k]) == len(unit.params):
                self._launch(k)
            self.overlapped_launches += len(self._launched) - launched

    def _grad_region(self, k: int, unit: Unit) -> torch.Tensor:
        """Where unit k's gradients accumulate during this backward."""
        if self.full_grads is not None:
            return self.flat.unit_full(unit, self.full_grads)
        if k not in self._staging:
            staging = self.pool.get(unit.padded_numel)
            staging[unit.layout.numel:].zero_()  # padding; parameter regions are written by their first gradient
            self._staging[k] = staging
        return self._staging[k]

    def _launch_ready(self) -> None:
        units = self.flat.units
        while self._next_launch < len(units) and len(self._seen[self._next_launch]) == len(units[self._next_launch].params):
            self._launch(self._next_launch)

    def _launch(self, k: int) -> None:
        unit = self.flat.units[k]
        region = self._grad_region(k, unit)
        if self.full_grads is None:
            for index, span in enumerate(unit.layout.spans):
                if index not in self._seen[k]:  # no gradient this backward (an unused parameter)
                    region[span.offset:span.end].zero_()
        if self.stage == 0:
            handle = self.comm.all_reduce(region)
        elif self.stage == 1:
            handle = self.comm.reduce_scatter(region, self.flat.unit_piece(unit, self.full_grads))
        else:
            out = self.flat.state_slice(unit, self.grad_shards[unit.group])
            handle = self.comm.reduce_scatter(region, out, accumulate=True)
        self._inflight.append((k, handle))
        while len(self._inflight) > MAX_INFLIGHT:  # bound staging memory: finish the oldest, recycle it
            self._finish(*self._inflight.popleft())
        self._launched.add(k)
        while self._next_launch in self._launched:
            self._next_launch += 1
        if self.on_launch is not None:
            self.on_launch(k)

    def end_backward(self) -> None:
        """After `loss.backward()`: reduce what is left, wait for every unit, recycle staging."""
        self._in_backward = False
        if self._reduce:
            for k in range(len(self.flat.units)):
                if k not in self._launched:
                    self._launch(k)
        while self._inflight:
            self._finish(*self._inflight.popleft())
        for buffer in self._staging.values():  # units that were not reduced (accumulation-only micro-steps)
            self.pool.put(buffer)
        self._reset_backward_state(reduce=False)

    def _finish(self, k: int, handle: Handle) -> None:
        handle.wait()
        staging = self._staging.pop(k, None)
        if staging is not None:
            self.pool.put(staging)

    # -- optimizer side ---------------------------------------------------------------------
    def grad_pieces(self, group: int) -> list[torch.Tensor]:
        """This rank's reduced (summed) gradients for `group`, aligned with `FlatParams.master_pieces`."""
        units = [u for u in self.flat.units if u.group == group]
        if self.grad_shards is not None:
            return [self.flat.state_slice(u, self.grad_shards[group]) for u in units]
        return [self.flat.unit_piece(u, self.full_grads) for u in units]

    def zero(self) -> None:
        for buffer in [self.full_grads] if self.full_grads is not None else self.grad_shards:
            buffer.zero_()

    def held_bytes(self) -> int:
        buffers = [self.full_grads] if self.full_grads is not None else self.grad_shards
        return sum(b.numel() * b.element_size() for b in buffers)

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
