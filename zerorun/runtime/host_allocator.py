"""How glibc treats the host memory freed during training (`zero.host_memory`: fast or lean).

Not memory accounting (`memory`) but a process-wide setting of the C library's allocator, so the
process that owns it decides: the worker calls `install()`, which follows the engine's setup through
`events.EngineSetup` (lean while the engine shards the model away, the recipe's mode after). An
engine built outside `zerorun launch` (a test, a notebook) tunes nothing unless its process installs it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Callable

from zerorun.runtime import context, events

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def set_host_allocator(mode: str) -> bool:
    """Tell glibc how to treat the host memory freed during training; False where the C library is not glibc.

    fast: keep freed blocks of up to 32 MiB for reuse instead of returning them to the OS, so the
    activations and gradients of every step do not fault in fresh pages (torch's CPU allocator has
    no cache). RSS follows the heap's high-water mark, fragmentation included, not the live tensors.

    lean: every block of 128 KiB or more is its own mapping, returned to the OS when freed, so RSS
    follows the live tensors at the price of a page fault for each page of every such block.

    Either way stage 3's gathered units, freed and made again twice a step, reuse their own memory
    (`BlockCache`). `zerorun bench step --systems zero3,zero3-lean --steps 40` measures the trade:
    lean is slower by its page faults, fast's RSS creeps up by fragmentation over the first steps.

    Both modes hand the free memory the heap holds now back to the OS: `install` sets `lean` while
    an engine sets up (the model it shards away, one-off buffers) and the training mode after it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    if mode == "fast":
        done = bool(mallopt(M_MMAP_THRESHOLD, 32 * 2**20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
    else:
        assert mode == "lean", mode
        done = bool(mallopt(M_MMAP_THRESHOLD, 128 * 2**10)) and bool(mallopt(M_TRIM_THRESHOLD, 128 * 2**10))
    malloc_trim(0)  # the free memory the heap kept from before (building the model, say) goes back now
    return done


def install(runtime: context.Runtime | None = None) -> Callable[[], None]:
    """Tune this process's allocator around every engine built in `runtime` (None: this thread's; the worker's
    call); returns the undo."""
    return (runtime or context.current()).events.subscribe_setup(follow_engine_setup)


def follow_engine_setup(setup: events.EngineSetup) -> None:
    """Lean while an engine sets up, then the recipe's mode: only where the recipe asks (lean) or stage 3
    trains on the CPU (its gathered units come and go every step), else the C library's defaults stay."""
    if setup.host_memory == "lean" or (setup.stage == 3 and setup.device_type == "cpu"):
        set_host_allocator(setup.host_memory if setup.done else "lean")
