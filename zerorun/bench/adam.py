"""`zerorun bench adam`: our CPU Adam(W) kernel against torch's, with memory bandwidth as the roofline.

The update reads params, grads and both moments and writes params and moments: 28 bytes per fp32
parameter (30 with a bf16 copy-out), so on a CPU it is memory-bound and the honest yardstick is the
machine's own bandwidth, measured here as a torch add over a large buffer (3 x 4 bytes per element).
It is a yardstick, not a hard ceiling: shards that fit in the last-level cache beat it, and one
core's bandwidth grows with the number of streams it keeps in flight (Adam has seven, the add three).
Every implementation updates the same flat shard sizes; a row's GB/s counts the bytes the update
must move, not what an implementation happens to move (the for-loop's temporaries are its cost).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

IMPLEMENTATIONS = ("zerorun", "zerorun+bf16", "torch fused", "torch fused+bf16", "torch foreach", "torch for-loop",
                   "deepspeed")  # DeepSpeedCPUAdam, where deepspeed imports (its op builds at first use)
HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


@dataclass
class AdamResult:
    numel: int
    implementation: str
    median_s: float | None  # None: not run (the note says why)
    bytes_per_param: int
    runs: int = 0
    note: str = ""

    @property
    def params_per_s(self) -> float:
        return self.numel / self.median_s if self.median_s else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.params_per_s * self.bytes_per_param / 1e9


@dataclass
class AdamBench:
    threads: int
    bandwidth_gb_s: float
    bandwidth_numel: int
    results: list[AdamResult]


def _time(fn: Callable[[], Any], repeats: int, budget_s: float) -> list[float]:
    """Wall times of `fn` after one warm-up: `repeats` runs, fewer if they exceed `budget_s` (at least one)."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < repeats and (not times or spent < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return times


def measure_bandwidth(numel: int, repeats: int = 5) -> float:
    """GB/s of `a.add_(b)` over `numel` fp32 elements (reads 2, writes 1), best of `repeats`.

    In place like the Adam update: an out-of-place add would also read its output's cache lines
    before writing them (write-allocate), traffic that 3 x 4 bytes does not count.
    """
    a, b = torch.rand(numel), torch.rand(numel)
    times = _time(lambda: a.add_(b), repeats, budget_s=5.0)
    return 3 * 4 * numel / min(times) / 1e9


def _torch_optimizer(kind: str, numel: int) -> Callable[[], None]:
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    flags: dict[str, dict[str, Any]] = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    optimizer = torch.optim.AdamW([param], **HYPER, **flags[kind.split("+")[0]])
    copy = torch.empty(numel, dtype=torch.bfloat16) if kind.endswith("+bf16") else None

    def step() -> None:
        optimizer.step()
        if copy is not None:
            copy.copy_(param.detach())
    return step


def _ours(numel: int, lowp: bool) -> Callable[[], None]:
    from zerorun import ops

    params, grads, exp_avg, exp_avg_sq = torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    copy = torch.empty(numel, dtype=torch.bfloat16) if lowp else None
    state = {"step": 0}
    beta1, beta2 = HYPER["betas"]

    def step() -> None:
        state["step"] += 1
        ops.adamw_step(params, grads, exp_avg, exp_avg_sq, step=state["step"], lr=HYPER["lr"], beta1=beta1,
                       beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], lowp_out=copy)
    return step


def _deepspeed(numel: int) -> Callable[[], None]:
    """DeepSpeedCPUAdam (AdamW) over one flat fp32 parameter, as DeepSpeed's ZeRO-Offload steps its shard."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    optimizer = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                                 weight_decay=HYPER["weight_decay"], adamw_mode=True)
    return optimizer.step


def _missing(name: str, ours: Any) -> str | None:
    """Why implementation `name` cannot run here, or None."""
    import importlib.util

    if name.startswith("zerorun") and ours.lib is None:
        return str(ours.reason)
    if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed does not import here"
    return None


def run(sizes: list[int], threads: int = 1, repeats: int = 10, implementations: tuple[str, ...] = IMPLEMENTATIONS,
        budget_s: float = 3.0, bandwidth_numel: int = 64 * 10**6) -> AdamBench:
    """Median step time of each implementation at each size, on `threads` CPU threads."""
    from zerorun import ops

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bandwidth = measure_bandwidth(bandwidth_numel)
        ours = ops.load_kernel("cpu_adam")  # the bench must not time torch's fallback under our name
        results = []
        for numel in sizes:
            for name in implementations:
                bytes_per_param = 30 if name.endswith("+bf16") else 28
                why = _missing(name, ours)
                if why is not None:
                    results.append(AdamResult(numel, name, None, bytes_per_param, note=why))
                    continue
                step = _ours(numel, name.endswith("+bf16")) if name.startswith("zerorun") \
                    else _deepspeed(numel) if name == "deepspeed" else _torch_optimizer(name.removeprefix("torch "), numel)
                times = _time(step, repeats, budget_s)
                results.append(AdamResult(numel, name, statistics.median(times), bytes_per_param, len(times)))
                del step
        return AdamBench(threads, bandwidth, bandwidth_numel, results)
    finally:
        torch.set_num_threads(previous)


def render(bench: AdamBench) -> Any:
    from rich.table import Table

    table = Table(title=f"Adam(W) step over one flat fp32 shard, {bench.threads} thread(s), median; roofline: "
                        f"torch add_ over {bench.bandwidth_numel:,} fp32 {bench.bandwidth_gb_s:.1f} GB/s; GB/s counts "
                        "28 B/param (30 with a bf16 copy)")
    for column in ("params", "implementation", "ms", "G params/s", "GB/s", "% of roofline", "runs"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    for r in bench.results:
        if r.median_s is None:
            table.add_row(f"{r.numel:,}", r.implementation, "-", "-", "-", "-", f"not run: {r.note}")
            continue
        table.add_row(f"{r.numel:,}", r.implementation, f"{r.median_s * 1e3:.2f}", f"{r.params_per_s / 1e9:.2f}",
                      f"{r.gb_per_s:.1f}", f"{100 * r.gb_per_s / bench.bandwidth_gb_s:.0f}%", str(r.runs))
    return table
