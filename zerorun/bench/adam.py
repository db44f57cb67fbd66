"""`zerorun bench adam`: our CPU Adam(W) kernel against torch's and DeepSpeed's, with memory bandwidth as the roofline.

The update reads params, grads and both moments and writes params and moments: 28 bytes per fp32
parameter (30 with a bf16 copy-out; 28 again with bf16 gradients and the bf16 copy, the engine's mixed
precision path), so on a CPU it is memory-bound and the honest yardstick is the machine's own
bandwidth, measured here as a torch add over a large buffer (3 x 4 bytes per element).
It is a yardstick, not a hard ceiling: shards that fit in the last-level cache beat it, and one
core's bandwidth grows with the number of streams it keeps in flight (Adam has seven, the add three).
A row's GB/s counts the bytes the update must move, not what an implementation happens to move (the
for-loop's temporaries are its cost).

Every implementation steps the same tensors, in turn: one round runs each once, the add included, in a
shuffled order, and the rounds repeat. A machine's bandwidth moves between levels from one second to the
next (two cores of a VM, neighbours' jobs), so timing each implementation in its own stretch would compare
moments, not implementations. Each row's ratio is the median over rounds of its time over the reference's time in
the same round: DeepSpeedCPUAdam where deepspeed imports, else torch's fused AdamW.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

IMPLEMENTATIONS = ("zerorun", "zerorun+bf16", "zerorun bf16 grads", "zerorun avx2", "zerorun avx512", "torch fused",
                   "torch fused+bf16", "torch foreach", "torch for-loop",
                   "deepspeed")  # DeepSpeedCPUAdam, where deepspeed imports (its op builds at first use)
ISA_ROWS = {"zerorun avx2": 1, "zerorun avx512": 2}  # the kernel's variant forced (ops.use_cpu_isa), else the default
BANDWIDTH = "memory (torch add_)"  # the roofline's row, timed in the same rounds
HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
GRAD_DIVISOR = 8.0  # "zerorun bf16 grads" unscales its gradients in the pass, as the engine does


@dataclass
class AdamResult:
    numel: int
    implementation: str
    median_s: float | None  # None: not run (the note says why)
    bytes_per_param: int
    runs: int = 0
    note: str = ""
    ratio: float | None = None  # median over rounds of this time / the reference's, in the same round

    @property
    def params_per_s(self) -> float:
        return self.numel / self.median_s if self.median_s else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.params_per_s * self.bytes_per_param / 1e9


@dataclass
class AdamBench:
    threads: int
    bandwidth_gb_s: float  # the median of the add's rounds over every size
    bandwidth_numel: int
    results: list[AdamResult]
    reference: str = "torch fused"
    isa: str = ""  # the variant the "zerorun" rows run (this CPU's default)


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


@dataclass
class _Shard:
    """The tensors every implementation steps in turn: one flat fp32 parameter, its gradient and moments."""
    params: torch.Tensor
    grads: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @classmethod
    def random(cls, numel: int) -> _Shard:
        return cls(torch.randn(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel))

    def parameter(self) -> torch.nn.Parameter:
        param = torch.nn.Parameter(self.params)
        param.grad = self.grads
        return param


def _torch_optimizer(kind: str, shard: _Shard) -> Callable[[], None]:
    param = shard.parameter()
    flags: dict[str, dict[str, Any]] = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    optimizer = torch.optim.AdamW([param], **HYPER, **flags[kind.split("+")[0]])
    optimizer.state[param] = {"step": torch.zeros(()), "exp_avg": shard.exp_avg, "exp_avg_sq": shard.exp_avg_sq}
    copy = torch.empty(param.numel(), dtype=torch.bfloat16) if kind.endswith("+bf16") else None

    def step() -> None:
        optimizer.step()
        if copy is not None:
            copy.copy_(param.detach())
    return step


def _ours(name: str, shard: _Shard) -> Callable[[], None]:
    from zerorun import ops

    numel = shard.params.numel()
    copy = torch.empty(numel, dtype=torch.bfloat16) if name in ("zerorun+bf16", "zerorun bf16 grads") else None
    bf16_grads = name == "zerorun bf16 grads"
    grads = shard.grads.bfloat16() if bf16_grads else shard.grads
    state = {"step": 0}
    beta1, beta2 = HYPER["betas"]

    def step() -> None:
        state["step"] += 1
        ops.adamw_step(shard.params, grads, shard.exp_avg, shard.exp_avg_sq, step=state["step"], lr=HYPER["lr"],
                       beta1=beta1, beta2=beta2, eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                       grad_divisor=GRAD_DIVISOR if bf16_grads else 1.0, lowp_out=copy)

    def step_variant() -> None:
        ops.use_cpu_isa(ISA_ROWS[name])
        try:
            step()
        finally:
            ops.use_cpu_isa(-1)
    return step_variant if name in ISA_ROWS else step


def _deepspeed(shard: _Shard) -> Callable[[], None]:
    """DeepSpeedCPUAdam (AdamW) over the flat fp32 shard, as DeepSpeed's ZeRO-Offload steps its partition."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = shard.parameter()
    optimizer = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                                 weight_decay=HYPER["weight_decay"], adamw_mode=True)
    optimizer.state[param] = {"step": 0, "exp_avg": shard.exp_avg, "exp_avg_sq": shard.exp_avg_sq}
    return optimizer.step


def _missing(name: str, ours: Any) -> str | None:
    """Why implementation `name` cannot run here, or None."""
    import importlib.util

    if name.startswith("zerorun") and ours.lib is None:
        return str(ours.reason)
    if name in ISA_ROWS:
        from zerorun import ops

        used = ops.use_cpu_isa(ISA_ROWS[name])
        ops.use_cpu_isa(-1)
        if f"zerorun {used}" != name:
            return f"this CPU has no {name.removeprefix('zerorun ')}"
    if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed does not import here"
    return None


def _step_of(name: str, shard: _Shard) -> Callable[[], None]:
    if name.startswith("zerorun"):
        return _ours(name, shard)
    if name == "deepspeed":
        return _deepspeed(shard)
    return _torch_optimizer(name.removeprefix("torch "), shard)


def _bytes_per_param(name: str) -> int:
    return 30 if name.endswith("+bf16") else 28


def _rounds(steps: dict[str, Callable[[], Any]], repeats: int, budget_s: float) -> dict[str, list[float]]:
    """Each step timed once per round, after one warm-up each: `repeats` rounds, fewer once they take more than
    `budget_s` per step (at least one). Each round's order is shuffled (the same shuffles every run): in a fixed
    cycle one implementation would always follow the add, which empties the caches, and another always follow
    an implementation that has just brought the shard into them."""
    for step in steps.values():
        step()
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    spent = 0.0
    shuffles = random.Random(0)
    for k in range(repeats):
        if k and spent > budget_s * len(names):
            break
        for name in shuffles.sample(names, len(names)):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
            spent += times[name][-1]
    return times


def _size(numel: int, implementations: tuple[str, ...], ours: Any, add: Callable[[], Any], repeats: int,
          budget_s: float) -> tuple[list[AdamResult], list[float]]:
    """The rows of one shard size, and the add's times from the same rounds."""
    shard = _Shard.random(numel)
    skipped = {name: why for name in implementations if (why := _missing(name, ours)) is not None}
    steps = {name: _step_of(name, shard) for name in implementations if name not in skipped}
    times = _rounds({**steps, BANDWIDTH: add}, repeats, budget_s)
    reference = "deepspeed" if "deepspeed" in steps else "torch fused" if "torch fused" in steps else None
    results = []
    for name in implementations:
        if name in skipped:
            results.append(AdamResult(numel, name, None, _bytes_per_param(name), note=skipped[name]))
            continue
        ratio = statistics.median(t / r for t, r in zip(times[name], times[reference])) if reference else None
        results.append(AdamResult(numel, name, statistics.median(times[name]), _bytes_per_param(name),
                                  len(times[name]), ratio=ratio))
    return results, times[BANDWIDTH]


def run(sizes: list[int], threads: int = 1, repeats: int = 10, implementations: tuple[str, ...] = IMPLEMENTATIONS,
        budget_s: float = 3.0, bandwidth_numel: int = 64 * 10**6) -> AdamBench:
    """Median step time of each implementation at each size, on `threads` CPU threads, in interleaved rounds."""
    from zerorun import ops

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = ops.load_kernel("cpu_adam")  # the bench must not time torch's fallback under our name
        a, b = torch.rand(bandwidth_numel), torch.rand(bandwidth_numel)
        results: list[AdamResult] = []
        add_times: list[float] = []
        for numel in sizes:
            rows, adds = _size(numel, implementations, ours, lambda: a.add_(b), repeats, budget_s)
            results += rows
            add_times += adds
        ran = {r.implementation for r in results if r.median_s is not None}
        reference = "deepspeed" if "deepspeed" in ran else "torch fused"
        bandwidth = 3 * 4 * bandwidth_numel / statistics.median(add_times) / 1e9
        isa = ops.use_cpu_isa(-1) if ours.lib is not None else ""
        return AdamBench(threads, bandwidth, bandwidth_numel, results, reference, isa)
    finally:
        torch.set_num_threads(previous)


def render(bench: AdamBench) -> Any:
    from rich.table import Table

    isa = f"; zerorun runs {bench.isa} here" if bench.isa else ""
    table = Table(title=f"Adam(W) step over one flat fp32 shard, {bench.threads} thread(s), median of interleaved "
                        f"rounds; roofline: torch add_ over {bench.bandwidth_numel:,} fp32 in the same rounds "
                        f"{bench.bandwidth_gb_s:.1f} GB/s; GB/s counts 28 B/param (30 for +bf16: fp32 grads and a "
                        f"bf16 copy); x {bench.reference}: median of the per-round ratios{isa}")
    for column in ("params", "implementation", "ms", "G params/s", "GB/s", "% of roofline",
                   f"x {bench.reference}", "runs"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    for r in bench.results:
        if r.median_s is None:
            table.add_row(f"{r.numel:,}", r.implementation, "-", "-", "-", "-", "-", f"not run: {r.note}")
            continue
        table.add_row(f"{r.numel:,}", r.implementation, f"{r.median_s * 1e3:.2f}", f"{r.params_per_s / 1e9:.2f}",
                      f"{r.gb_per_s:.1f}", f"{100 * r.gb_per_s / bench.bandwidth_gb_s:.0f}%",
                      "-" if r.ratio is None else f"{r.ratio:.3f}", str(r.runs))
    return table
