"""`zero.quantized_gradients: auto` / `quantized_weights: auto`: int8 on the wire only where it pays.

Block int8 sends a quarter of fp32's bytes, but the codec costs time on both ends: quantizing before
the bytes leave, dequantizing and adding after they land. Per byte of fp32 data that crosses, the
exact collective costs 1/L (L: the link's rate, per rank) and the quantized one 0.25/L plus the
codec's time per byte. Over a slow link the codec is cheap beside the bytes it saves (the emulated
1 Gbit/s cluster: quantized stage 2 at about half of exact stage 2's step); over a fast one it is not
(10 Gbit/s: a few percent slower, `zerorun bench step --cluster 2x1 --link 10gbit`, docs/cluster.md).

So `auto` measures both where the job runs, once, at setup: an exact all-gather over the level that
crosses the network (the whole group, or across nodes where the collectives are hierarchical) and the
codec on this rank's device, the slowest rank's figures taken everywhere so every rank decides alike.
Compression goes on where the codec's time per byte is under 0.75/L / MARGIN: the bytes it saves,
with a margin because its time lands on the ranks' cores while the link's is partly hidden under the
backward. Rank 0 says what it decided, and why, once. Where nothing crosses a network (every rank on
one host through shared memory) it stays off without measuring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zerorun.runtime.comm.hier_collectives import LevelCollectives

MARGIN = 2.0
PROBE_NUMEL = 2**22  # fp32 elements a rank contributes to the link's probe, and the codec's (16 MiB)


@dataclass(frozen=True)
class Rates:
    """Seconds per byte of fp32 data: moved over the link by one rank, and through the codec (both ends)."""

    link_s_per_byte: float
    codec_s_per_byte: float

    @property
    def pays(self) -> bool:
        return self.codec_s_per_byte < 0.75 * self.link_s_per_byte / MARGIN

    def describe(self) -> str:
        return (f"the link moves {1e-9 / self.link_s_per_byte:.2f} GB/s per rank and the codec "
                f"{1e-9 / self.codec_s_per_byte:.2f} GB/s of fp32, so int8 "
                f"{'saves more than it costs' if self.pays else 'would cost more than it saves'}")


def measure(network: LevelCollectives, device: torch.device) -> Rates:
    """The link's and the codec's rates (module docstring); a collective: every rank of `network` calls it."""
    from zerorun.runtime.comm.quantize import dequantize_add, quantize

    full = torch.zeros(network.world_size * PROBE_NUMEL, device=device)
    seconds = []
    for _ in range(2):  # the first warms the connections up
        started = time.perf_counter()
        network.all_gather(full).wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    sent = 4 * PROBE_NUMEL * (network.world_size - 1)  # this rank's piece to every peer
    values = torch.randn(PROBE_NUMEL, device=device)
    started = time.perf_counter()
    dequantize_add(quantize(values), values)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    codec = time.perf_counter() - started
    slowest = torch.tensor([seconds[-1] / sent, codec / (4 * PROBE_NUMEL)], dtype=torch.float64, device=device)
    network.all_reduce(slowest, op=dist.ReduceOp.MAX, async_op=False).wait()
    return Rates(float(slowest[0]), float(slowest[1]))
