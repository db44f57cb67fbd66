"""Gradient reduction for every stage: collect, accumulate, reduce across ranks, unit by unit.

A post-accumulate-grad hook on every trainable parameter moves the fresh gradient out of
`param.grad` into an fp32 buffer laid out like the parameters' units, then frees it. When all
parameters of a unit have reported, the unit's gradients are reduced asynchronously while backward
continues (`overlap_comm`).

| stage | `Reduction`     | what a rank keeps                  | when it communicates      | collective per unit       |
|-------|-----------------|------------------------------------|---------------------------|---------------------------|
| 0     | `ALL_REDUCE`    | full gradients                     | last micro-step of a step | all-reduce                |
| 1     | `SCATTER_FULL`  | full gradients (steps its piece)   | last micro-step of a step | reduce-scatter, in place  |
| 2, 3  | `SCATTER_SHARD` | only its gradient shard            | every micro-step          | reduce-scatter into shard |

`SCATTER_SHARD` copies each unit's gradients into a pooled staging buffer that lives only until the
unit's reduce-scatter finishes, so no full-size gradient buffer exists. A unit that is one parameter
with no padding (an output head cut on its own) is reduce-scattered from autograd's gradient itself.
A unit's first gradients are held as they came until they make up half the unit: a unit whose
parameters get gradients far apart in backward (stage 3's root: the final norm's first, the
embedding's last) then takes a staging buffer for a moment at the end, not for the whole backward.

Launch order (`LaunchOrder`): stages 0-2 launch strictly in layout order (a ready unit waits for
the ones before it), so every rank issues the same collectives in the same order even if hooks fire
in another order; at stage 3 each unit's `UnitGroup` (stage3/unit_group.py) hooks its own parameters,
hands their gradients to `accept` and launches each unit as soon as it is complete (backward's own
order, the same on every rank for the same graph), then frees its parameters, as FSDP2's group
does. Units
whose parameters got no gradient (an unused branch) are reduced at the end of backward, with zeros.
Gradients are *summed* across ranks; the optimizer divides by the world size in its own pass.
"""

from __future__ import annotations

from collections import deque
from enum import Enum
from typing import Callable

import torch
from torch import nn

from zerorun.errors import ZerorunError
from zerorun.runtime.comm.collectives import Collectives, Handle
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.phase import Phase, TrainingPhase
from zerorun.runtime.store import ParamStore, units_of
from zerorun.runtime.units import Unit

MAX_INFLIGHT = 2  # unit reductions in flight at once; beyond that the oldest is finished first


class Reduction(Enum):
    """How a unit's gradients are combined across ranks (see the module docstring)."""

    ALL_REDUCE = 0
    SCATTER_FULL = 1
    SCATTER_SHARD = 2

    @classmethod
    def for_stage(cls, stage: int) -> Reduction:
        return {0: cls.ALL_REDUCE, 1: cls.SCATTER_FULL}.get(stage, cls.SCATTER_SHARD)


class LaunchOrder(Enum):
    LAYOUT = "layout"  # strictly in unit order: the same collective sequence on every rank
    READY = "ready"  # each unit as soon as all its gradients arrived, launched by its group (stage 3, unit_group.py)


class BufferPool:
    """Reusable staging buffers, so reducing into a shard does not allocate on every micro-step.

    A unit gets (a view of) the smallest free buffer that holds it; a new buffer is made only when
    none does, at the largest unit's size for any unit over half of it, so that units of nearly equal
    size (cut at parameter boundaries) share buffers. Pooling by exact size kept a set per distinct
    unit size, most of them idle (the "live" column of `zerorun bench step` showed it).
    The pool never holds more buffers than were in use at one time, each at most the largest unit,
    and holds them only during a backward: `release` at its end hands them to the allocator (on CUDA
    its cache, on the host glibc's heap under `host_memory: fast`), so the optimizer step and the next
    forward can use that memory (`zerorun bench step`'s "live" column counts what is left).
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, slot_numel: int) -> None:
        self.dtype, self.device, self.slot_numel = dtype, device, slot_numel
        self._free: list[torch.Tensor] = []
        self.allocated_bytes = 0  # held now, in use or free
        self.peak_bytes = 0  # the most held at once
        self._element = torch.empty((), dtype=dtype).element_size()

    def get(self, numel: int) -> torch.Tensor:
        """A buffer of `numel` elements with undefined contents (the caller writes or zeroes every element)."""
        fits = [i for i, b in enumerate(self._free) if b.numel() >= numel]
        if fits:
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        else:
            # every free buffer is too small: drop them, so there are never more buffers than were in use at
            # once (small ones kept beside new large ones made the total depend on the order transfers finish)
            self.release()
            size = self.slot_numel if 2 * numel > self.slot_numel else numel
            self.allocated_bytes += size * self._element
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            buffer = torch.empty(size, dtype=self.dtype, device=self.device)
        return buffer[:numel]

    def put(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer._base if buffer._base is not None else buffer)  # the buffer `get` gave a view of

    def release(self) -> None:
        """Drop every free buffer (those in use stay theirs)."""
        self.allocated_bytes -= sum(b.numel() for b in self._free) * self._element
        self._free.clear()


class GradReducer:
    """Receives gradients from backward hooks and leaves this rank's reduced pieces ready to step."""

    def __init__(self, store: ParamStore, comm: Collectives, dtype: torch.dtype, device: torch.device,
                 reduction: Reduction, order: LaunchOrder, overlap: bool, phase: TrainingPhase) -> None:
        """`dtype` is the reduce dtype. With `LaunchOrder.LAYOUT` the reducer hooks every parameter and launches
        itself; with `READY` the caller (stage 3's unit groups) hooks them and calls `accept` and `launch`."""
        self.units, self.group_numels, self.rank = store.units, store.group_numels, store.shard_rank
        self.comm, self.reduction, self.order, self.overlap = comm, reduction, order, overlap
        self.phase = phase
        self.on_reduced: Callable[[int], None] | None = None  # told when unit k's reduced gradient is ready (waited)
        self.staged = reduction is Reduction.SCATTER_SHARD  # per-unit staging; only this rank's shard is kept
        self._range = "all-reduce" if reduction is Reduction.ALL_REDUCE else "reduce-scatter"  # in a profile's trace
        total = 0 if self.staged else sum(u.padded_numel for u in self.units)
        self.full_grads = torch.zeros(total, dtype=dtype, device=device)  # stages 0/1: laid out like the parameters
        shards = self.group_numels if self.staged else []
        self.grad_shards = [torch.zeros(n, dtype=dtype, device=device) for n in shards]
        self.pool = BufferPool(dtype, device, max((u.padded_numel for u in self.units), default=1))
        self._place = {param: (k, i) for k, unit in enumerate(self.units) for i, param in enumerate(unit.params)}
        self._hooks = ([p.register_post_accumulate_grad_hook(self._on_grad) for p in self._place]
                       if order is LaunchOrder.LAYOUT else [])
        self._reset_backward_state(reduce=False)
        self._written_units: set[int] = set()  # staged: units whose shard piece holds this window's sum
        self._written_params: set[tuple[int, int]] = set()  # full: (unit, parameter) holding this window's gradient
        self.overlapped_launches = 0  # units whose reduction started while backward was still running
        self.direct_launches = 0  # units reduced from autograd's gradient itself, with no staging copy

    # -- backward ---------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        """Called by the engine before `loss.backward()`; `reduce` is False on accumulation-only micro-steps."""
        self._reset_backward_state(reduce or self.reduction is Reduction.SCATTER_SHARD)

    def _reset_backward_state(self, reduce: bool) -> None:
        self._reduce = reduce
        self._seen: list[set[int]] = [set() for _ in self.units]
        self._staging: dict[int, torch.Tensor] = {}
        self._direct: set[int] = set()  # units whose region is autograd's gradient itself, not a pooled buffer
        self._held: dict[int, dict[int, torch.Tensor]] = {}  # unit -> parameter index -> gradient not yet staged
        self._inflight: deque[tuple[int, Handle]] = deque()
        self._next_launch = 0
        self._launched: set[int] = set()

    def _on_grad(self, param: nn.Parameter) -> None:
        """Stages 0-2's hook: take the gradient, then launch every unit ready in layout order."""
        if self.accept(param) is None or not (self.overlap and self._reduce):
            return
        launched = len(self._launched)
        self._launch_ready()
        self.overlapped_launches += len(self._launched) - launched

    def accept(self, param: nn.Parameter) -> int | None:
        """Move `param`'s fresh gradient out of `param.grad` into its unit's staging; the unit's index, or None
        while the gradient is only held (`launches_now` then says whether the unit can go)."""
        if self.phase.now is not Phase.BACKWARD:
            raise ZerorunError("a gradient arrived outside engine.backward(loss): call engine.backward(loss), "
                               "not loss.backward(), so zerorun can reduce gradients across ranks.")
        k, index = self._place[param]
        grad, param.grad = param.grad, None
        assert grad is not None, "a post-accumulate-grad hook runs with the gradient in place"
        if k in self._launched:
            raise ZerorunError(
                f"parameter {tuple(param.shape)} received a second gradient after its bucket was reduced "
                "(a parameter used in two re-entrant checkpoint regions?); set zero.overlap_comm: false.")
        held = self._held.setdefault(k, {}) if self.staged and k not in self._staging else None
        if held is not None and self._reducible_as_is(k, index, grad):
            self._staging[k] = grad.view(-1)  # the gradient is the unit's whole region: reduced from where it is
            self._direct.add(k)
            self._seen[k].add(index)
        elif held is not None and index not in held and not self._complete(k, index):
            held[index] = grad
            self._seen[k].add(index)
            if 2 * sum(g.numel() for g in held.values()) < self.units[k].padded_numel:
                return None
            self._grad_region(k)  # half the unit is here: stage it, with what was held
        else:  # (a second gradient for a held parameter is added in the staging buffer, as any other)
            self._accumulate(k, index, grad)
        return k

    def launches_now(self, k: int) -> bool:
        """Whether unit k has all its gradients and this backward reduces them while it runs (`overlap_comm`,
        and not an accumulation-only micro-step of stages 0-1)."""
        return self.overlap and self._reduce and self._complete(k) and k not in self._launched

    def launch(self, k: int) -> None:
        """Start unit k's reduction now, while backward runs (stage 3's groups call it; `launches_now` first)."""
        self._launch(k)
        self.overlapped_launches += 1

    def _reducible_as_is(self, k: int, index: int, grad: torch.Tensor) -> bool:
        """Whether unit k is this one gradient, laid out as the unit's region (one parameter, no padding, the
        reduce dtype), seen first now: it is then reduce-scattered from autograd's tensor, with no staging
        copy (the output head of a GPT: its gradient is not held twice at the start of backward)."""
        unit = self.units[k]
        return (len(unit.params) == 1 and unit.padded_numel == grad.numel()
                and grad.dtype == self.pool.dtype and grad.device == self.pool.device and grad.is_contiguous()
                and index not in self._seen[k])

    def _accumulate(self, k: int, index: int, grad: torch.Tensor) -> None:
        span = self.units[k].layout.spans[index]
        region = self._grad_region(k)[span.offset:span.end]
        if self._written(k, index):
            region.add_(grad.view(-1))
        else:  # the first gradient overwrites: a fresh staging buffer, or a full buffer not written since `zero`
            region.copy_(grad.view(-1))
        self._seen[k].add(index)
        if not self.staged:
            self._written_params.add((k, index))

    def _written(self, k: int, index: int) -> bool:
        """Whether unit k's parameter `index` has its gradient in the region: this backward (staged, a fresh
        buffer each backward) or since `zero` (full buffers, which accumulate across micro-steps)."""
        return index in self._seen[k] if self.staged else (k, index) in self._written_params

    def _complete(self, k: int, arriving: int | None = None) -> bool:
        """All of unit k's parameters have their gradient (counting `arriving`, one coming in now)."""
        seen = self._seen[k] if arriving is None else self._seen[k] | {arriving}
        return len(seen) == len(self.units[k].params)

    def _grad_region(self, k: int) -> torch.Tensor:
        """Where unit k's gradients accumulate during this backward."""
        unit = self.units[k]
        if not self.staged:
            return self._full_region(unit)
        if k not in self._staging:
            staging = self.pool.get(unit.padded_numel)
            for lo, hi in unit.layout.gaps():  # padding; parameter regions are written by their first gradient
                staging[lo:hi].zero_()
            self._staging[k] = staging
            for index, grad in self._held.pop(k, {}).items():
                span = unit.layout.spans[index]
                staging[span.offset:span.end].copy_(grad.view(-1))
        return self._staging[k]

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.units) and self._complete(self._next_launch):
            self._launch(self._next_launch)

    def _launch(self, k: int) -> None:
        unit, region = self.units[k], self._grad_region(k)
        for index, span in enumerate(unit.layout.spans):
            if not self._written(k, index):  # an unused parameter's gradient is zero
                region[span.offset:span.end].zero_()
        with self.phase.ranges.named(self._range):
            self._inflight.append((k, self._collective(k, region)))
        self.direct_launches += k in self._direct
        # bound staging memory: finish the oldest beyond the limit, and any already done (recycled at once)
        while self._inflight and (len(self._inflight) > MAX_INFLIGHT or self._inflight[0][1].ready):
            self._finish(*self._inflight.popleft())
        self._launched.add(k)
        while self._next_launch in self._launched:
            self._next_launch += 1

    def _collective(self, k: int, region: torch.Tensor) -> Handle:
        unit = self.units[k]
        if self.reduction is Reduction.ALL_REDUCE:
            return self.comm.all_reduce(region, unit=k)
        if self.reduction is Reduction.SCATTER_FULL:
            return self.comm.reduce_scatter(region, unit.piece(region, self.rank), unit=k, used=unit.layout.used)
        accumulate = k in self._written_units  # the window's first reduce writes the shard piece
        self._written_units.add(k)
        return self.comm.reduce_scatter(region, unit.state_slice(self.grad_shards[unit.group]), accumulate=accumulate,
                                        unit=k, used=unit.layout.used)

    def end_backward(self) -> None:
        """After `loss.backward()`: reduce what is left, wait for every unit, recycle staging."""
        if self._reduce:
            for k in range(len(self.units)):
                if k not in self._launched:
                    self._launch(k)
        while self._inflight:
            self._finish(*self._inflight.popleft())
        for k, buffer in self._staging.items():  # units that were not reduced (accumulation-only micro-steps)
            if k not in self._direct:
                self.pool.put(buffer)
        self.pool.release()
        self._reset_backward_state(reduce=False)

    def _finish(self, k: int, handle: Handle) -> None:
        with self.phase.ranges.named(f"{self._range} wait"):
            handle.wait()
        staging = self._staging.pop(k, None)
        if staging is not None and k not in self._direct:
            self.pool.put(staging)
        if self.on_reduced is not None:
            self.on_reduced(k)

    # -- optimizer side ---------------------------------------------------------------------
    def grad_pieces(self, group: int) -> list[torch.Tensor]:
        """This rank's reduced (summed) gradients for `group`, one per unit in state order."""
        units = units_of(self.units, group)
        if self.staged:
            return [u.state_slice(self.grad_shards[group]) for u in units]
        return [u.piece(self._full_region(u), self.rank) for u in units]

    def _full_region(self, unit: Unit) -> torch.Tensor:
        return self.full_grads[unit.flat_offset:unit.flat_offset + unit.padded_numel]

    def zero(self) -> None:
        """Start a new accumulation window. Nothing is cleared: the window's first write to each gradient
        overwrites instead of adding (a memset of the full gradients showed in stage 1's optimizer phase
        in `zerorun bench step`), and a parameter with no gradient in the window is zeroed when reduced."""
        self._written_units.clear()
        self._written_params.clear()

    def held_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers())

    def account(self, report: MemoryReport) -> None:
        """Add the gradient buffers this rank holds, and the peak of the reduce staging (held during a
        backward only), to `report`."""
        place = self.pool.device.type  # the reducer's device
        report.add("grads", place, self.held_bytes())
        report.add("comm", place, self.pool.peak_bytes)

    def _buffers(self) -> list[torch.Tensor]:
        return self.grad_shards if self.staged else [self.full_grads]

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
