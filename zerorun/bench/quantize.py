"""`zerorun bench quantize`: the block int8 codec of qwZ/qgZ, our kernel against torch's path, with memory
bandwidth as the roofline.

Each operation is one sweep's worth of bytes at least: quantizing reads 4 bytes per fp32 element and
writes 1 (plus a scale per 2048), dequantizing reads 1 and writes 4, dequantize-and-add also reads the 4
it adds to. A row's GB/s counts those bytes, not what an implementation happens to move (torch's
passes over its fp32 scratch are its cost). The roofline is `zerorun bench adam`'s on a CPU, a torch add
over a buffer larger than the cache; on a CUDA device (`device="cuda"`: kernels/quantize.cu), a
device-to-device copy, each call timed to a device synchronisation. Every implementation gives the same
bits (tests/test_quantize_kernel.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zerorun.bench.adam import _time, measure_bandwidth

OPERATIONS = {"quantize": 4 + 1, "dequantize": 1 + 4, "dequantize+add": 1 + 4 + 4}  # bytes per element
IMPLEMENTATIONS = ("zerorun", "torch")


@dataclass
class CodecResult:
    numel: int
    operation: str
    implementation: str
    median_s: float | None  # None: not run (the note says why)
    runs: int = 0
    note: str = ""

    @property
    def gb_per_s(self) -> float:
        return self.numel * OPERATIONS[self.operation] / self.median_s / 1e9 if self.median_s else 0.0


@dataclass
class CodecBench:
    threads: int
    bandwidth_gb_s: float
    bandwidth_numel: int
    results: list[CodecResult]
    device: str = "cpu"


def copy_bandwidth(numel: int, device: torch.device, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy of `numel` fp32 (4 bytes read, 4 written), best of `repeats`."""
    a, b = torch.rand(numel, device=device), torch.empty(numel, device=device)
    times = _time(_synced(lambda: b.copy_(a), device), repeats, budget_s=5.0)
    return 8 * numel / min(times) / 1e9


def _synced(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """`fn`, then wait for the device's work (a CUDA call returns when it is queued, not done)."""
    if device.type != "cuda":
        return fn

    def call() -> None:
        fn()
        torch.cuda.synchronize(device)
    return call


def _operation(operation: str, implementation: str, numel: int, device: torch.device = torch.device("cpu")
               ) -> Callable[[], Any]:
    from zerorun.runtime.comm import quantize as codec

    x = torch.randn(numel, device=device)
    q = codec.quantize(x)
    out = torch.empty(numel, device=device)
    if implementation == "zerorun":
        return {"quantize": lambda: codec.quantize(x), "dequantize": lambda: codec.dequantize_into(q, out),
                "dequantize+add": lambda: codec.dequantize_add(q, out)}[operation]
    # the fallbacks themselves: what runs where the kernel is not built
    return {"quantize": lambda: codec.torch_quantize(x, codec.Quantized.empty(numel, device)),
            "dequantize": lambda: codec.torch_dequantize_into(q, out),
            "dequantize+add": lambda: codec.torch_dequantize_add(q, out)}[operation]


def run(sizes: list[int], threads: int = 1, repeats: int = 10, budget_s: float = 3.0,
        bandwidth_numel: int = 64 * 10**6, device: str = "cpu") -> CodecBench:
    """Median time of each operation and implementation at each size, on `threads` CPU threads or a CUDA device."""
    from zerorun import ops

    place = torch.device(device)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = measure_bandwidth(bandwidth_numel) if place.type == "cpu" else copy_bandwidth(bandwidth_numel, place)
        # the bench must not time torch's fallback under our name
        ours = ops.load_kernel("quantize" if place.type == "cpu" else "quantize_cuda")
        results = []
        for numel in sizes:
            for operation in OPERATIONS:
                for name in IMPLEMENTATIONS:
                    if name == "zerorun" and ours.lib is None:
                        results.append(CodecResult(numel, operation, name, None, note=ours.reason))
                        continue
                    times = _time(_synced(_operation(operation, name, numel, place), place), repeats, budget_s)
                    results.append(CodecResult(numel, operation, name, statistics.median(times), len(times)))
        return CodecBench(threads, bandwidth, bandwidth_numel, results, place.type)
    finally:
        torch.set_num_threads(previous)


def render(bench: CodecBench) -> Any:
    from rich.table import Table

    where = f"{bench.threads} thread(s)" if bench.device == "cpu" else bench.device
    roof = "torch add_" if bench.device == "cpu" else "a device-to-device copy"
    table = Table(title=f"block int8 codec (blocks of 2048, fp32 in and out), {where}, median; roofline: {roof} "
                        f"over {bench.bandwidth_numel:,} fp32 {bench.bandwidth_gb_s:.1f} GB/s; "
                        "GB/s counts 5 B/element (9 for dequantize+add)")
    for column in ("elements", "operation", "implementation", "ms", "GB/s", "% of roofline", "runs"):
        table.add_column(column, justify="left" if column in ("operation", "implementation") else "right")
    for r in bench.results:
        if r.median_s is None:
            table.add_row(f"{r.numel:,}", r.operation, r.implementation, "-", "-", "-", f"not run: {r.note}")
            continue
        table.add_row(f"{r.numel:,}", r.operation, r.implementation, f"{r.median_s * 1e3:.2f}", f"{r.gb_per_s:.1f}",
                      f"{100 * r.gb_per_s / bench.bandwidth_gb_s:.0f}%", str(r.runs))
    return table
