"""`zerorun bench step --compile`: a system's model compiled as a script would, and what dynamo did with it.

A system name with a suffix is compiled before it trains (`zero2+compile`: `torch.compile(model)`
before `zerorun.initialize`, as `torch.compile(DDP(model))` for DDP; `zero3+compile-blocks`: each
block replaced by `torch.compile(block)`, torchtitan's way). Each compiled row reports its graphs,
graph breaks and frames dynamo left to Python, so that a compiled run that quietly runs eagerly is
seen; the compile tests check the same counts. They are dynamo's own counters
(`torch._dynamo.utils.counters`, the numbers `torch._dynamo.explain` and TORCH_LOGS=graph_breaks
report): `frames` counts the Python frames dynamo tried to compile and those it compiled ("ok"); a
frame that was tried and not compiled runs as plain Python, whole (a graph break dynamo could not
split there, e.g. inside a module call); `graph_break` counts the breaks it did split a frame at.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

COMPILE_SUFFIXES = {"+compile": "whole", "+compile-blocks": "block"}  # system suffix -> how the model is compiled
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
COMPILED_BASES = ("ddp", "zero")  # systems with compiled twins (FSDP2's and DeepSpeed's own hooks are theirs)


def split_system(system: str) -> tuple[str, str | None]:
    """`zero3+compile-blocks` -> ("zero3", "block"); a system without a suffix -> (system, None)."""
    for suffix, mode in COMPILE_SUFFIXES.items():
        if system.endswith(suffix):
            return system[:-len(suffix)], mode
    return system, None


def describe_mode(mode: str) -> str:
    return "torch.compile(model)" if mode == "whole" else "torch.compile(each block)"


@contextlib.contextmanager
def fresh_cache() -> Iterator[None]:
    """Inductor's compile cache in a new directory for one benchmark run (the rank processes inherit it), so
    the first round compiles from nothing, as a first run does, and the later rounds show a warm cache."""
    saved = os.environ.get(CACHE_ENV)
    with tempfile.TemporaryDirectory(prefix="zerorun-bench-inductor-") as directory:
        os.environ[CACHE_ENV] = directory
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(CACHE_ENV, None)
            else:
                os.environ[CACHE_ENV] = saved


def compile_blocks(model: Any) -> None:
    """Replace each of the GPT's blocks by `torch.compile(block)` (its hooks then stay outside the graph)."""
    import torch

    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)


@dataclass(frozen=True)
class DynamoCounts:
    """Since the last `reset`: what dynamo compiled, split and gave up on."""

    graphs: int = 0  # distinct graphs compiled
    graph_breaks: int = 0  # frames split in two around something dynamo could not trace
    eager_frames: int = 0  # frames dynamo tried and ran as Python instead (a break it could not split)
    reasons: list[str] = field(default_factory=list)  # the first line of each reason dynamo gave

    def describe(self) -> str:
        eager = f", {self.eager_frames} frame{'s' if self.eager_frames != 1 else ''} left eager" \
            if self.eager_frames else ""
        return f"{self.graphs} graph{'s' if self.graphs != 1 else ''}, {self.graph_breaks} breaks{eager}"


def reset() -> None:
    """Forget compiled code and counters: the next compiled call compiles (and counts) from scratch."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def counts() -> DynamoCounts:
    from torch._dynamo.utils import counters

    frames = counters["frames"]
    reasons = [*counters["graph_break"], *counters["unimplemented"]]
    return DynamoCounts(graphs=int(counters["stats"]["unique_graphs"]),
                        graph_breaks=int(sum(counters["graph_break"].values())),
                        eager_frames=int(frames["total"] - frames["ok"]),
                        reasons=sorted({str(r).strip().splitlines()[0] for r in reasons}))
