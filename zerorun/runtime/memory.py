"""Memory accounting: bytes held per kind of state and per place.

The engine fills a `MemoryReport` from the tensors it actually holds; telemetry, tests and
`zerorun estimate` read the same kinds, so the planner can be checked against reality.

Kinds: params (the module's parameters as held on this rank), grads (gradient accumulation
buffers or shards), master (fp32 master weights when they are a copy), optimizer (Adam moments),
buffers (module buffers), comm (staging buffers for collectives). Places: cpu, cuda, nvme.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch

# "gathered": stage 3 blocks gathered ahead of the next forward (overlap_comm), the gather window's
# working memory rather than a model state (`zerorun estimate` counts it with the working buffers);
# "snapshot": the host copy a background checkpoint writes from, kept between saves (checkpoint/snapshot.py);
# "backup": the host optimizer's copy of its state for an exact rollback (optim/overlap.py)
KINDS = ("params", "grads", "master", "optimizer", "buffers", "comm", "gathered", "snapshot", "backup")
MODEL_STATE_KINDS = ("params", "grads", "master", "optimizer")


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages behind `tensors` (views of one buffer count once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


class BlockCache:
    """Host memory blocks kept at exact sizes for buffers that are freed and made again at the same
    sizes all through a backward (stage 3's gathered units: released after forward, gathered again
    for backward).

    A block moves into a buffer's storage and back out by swapping data pointers, so the storage
    object (which the module's parameter views and tensors autograd saved all hold) stays the same,
    as with `resize_`. Unlike `resize_`, which is `free` and `malloc` on the host (torch's CPU
    allocator keeps nothing), a released block waits here for the next gather of its size, so
    glibc's heap is not churned by blocks of up to 25 MiB between the activations, which fragmented
    it (stage 3's peak RSS in `zerorun bench step` fell with it, at no cost in step time). `drop_idle` hands the idle blocks back at the end
    of a backward, so nothing is held through the optimizer step.
    """

    def __init__(self) -> None:
        self._idle: dict[int, list[torch.UntypedStorage]] = defaultdict(list)

    @staticmethod
    def supported() -> bool:
        """Whether this torch can swap storages' memory (`UntypedStorage._swap_data_ptr_`)."""
        return hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty `storage` `nbytes` of memory (contents undefined): an idle block, or a new one."""
        assert storage.nbytes() == 0, "fill an empty storage"
        idle = self._idle[nbytes]
        block = idle.pop() if idle else torch.UntypedStorage(nbytes, device=storage.device)
        storage._swap_data_ptr_(block)  # type: ignore[attr-defined]  # private in torch; supported() checks it. storage takes the memory; the block object is left empty

    def take(self, storage: torch.UntypedStorage) -> None:
        """Move `storage`'s memory here as an idle block; `storage` is left with none."""
        if storage.nbytes():
            block = torch.UntypedStorage(0, device=storage.device)
            block._swap_data_ptr_(storage)  # type: ignore[attr-defined]  # as in fill
            self._idle[block.nbytes()].append(block)

    def idle_bytes(self) -> int:
        return sum(nbytes * len(blocks) for nbytes, blocks in self._idle.items())

    def drop_idle(self) -> None:
        self._idle.clear()


class AllocatorBlocks:
    """`BlockCache`'s interface on the allocator itself (`resize_`): for CUDA, whose caching allocator
    keeps freed blocks, and for a torch that cannot swap storages' memory."""

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        storage.resize_(nbytes)

    def take(self, storage: torch.UntypedStorage) -> None:
        storage.resize_(0)

    def idle_bytes(self) -> int:
        return 0

    def drop_idle(self) -> None:
        pass


def gather_blocks(device: torch.device) -> BlockCache | AllocatorBlocks:
    """Where stage 3's gathered buffers on `device` get their memory."""
    return BlockCache() if device.type == "cpu" and BlockCache.supported() else AllocatorBlocks()


@dataclass
class MemoryReport:
    """Bytes per (kind, place)."""

    entries: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    units: int = 0  # stage 3: module units gathered and released around their use (0 in stages 0-2)
    # the owner way (optim/ownership.py): the busiest rank's share of the whole parameters over the mean (1.0: even,
    # or no optimizer runs on whole parameters); its state on this rank is within this factor of 1/N
    optimizer_imbalance: float = 1.0

    def add(self, kind: str, place: str, nbytes: int) -> None:
        assert kind in KINDS, f"unknown memory kind {kind}"
        if nbytes:
            self.entries[(kind, place)] += nbytes

    def total(self, kind: str | None = None, place: str | None = None) -> int:
        return sum(b for (k, p), b in self.entries.items()
                   if (kind is None or k == kind) and (place is None or p == place))

    def model_states(self) -> int:
        """params + grads + master + optimizer: what the ZeRO formulas describe."""
        return sum(self.total(kind) for kind in MODEL_STATE_KINDS)

    def as_dict(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (kind, place), nbytes in sorted(self.entries.items()):
            out[kind][place] = nbytes
        return dict(out)
