"""`zerorun bench scale`: the largest GPT of the standard family each system trains on this machine.

For each system (DDP; zerorun stage 3 with optimizer and parameters on the CPU; the same on NVMe)
the planner (`scale_plan.py`, i.e. `zerorun estimate`'s formulas) predicts the largest rung of the
family that fits the RAM and disk budget; that rung is then trained for real (`steps` steps, 2
ranks x 1 thread, gloo, fp32 AdamW, stage 3 built with `sharded_init`), and if it fails the search
walks down. Each rank watches its own RSS and stops the run the moment it passes its share of the
budget, so a wrong prediction ends as "over budget", never as the kernel's OOM killer on a shared
machine. The report says whether the prediction held.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerorun.bench.gpt import GPT, GPTConfig, synthetic_tokens
from zerorun.bench.scale_plan import (
    DESCRIPTIONS,
    GIB,
    OVERRIDES,
    Budget,
    Family,
    Prediction,
    largest_fitting,
    next_to_try,
    predict,
)
from zerorun.bench.spawn import RankFailure, run_ranks
from zerorun.runtime.store import ParamIO

OVER_BUDGET_EXIT = 86


@dataclass
class ScaleConfig:
    systems: tuple[str, ...]
    family: Family
    budget: Budget
    max_rung: int = 8
    max_params: int | None = None
    steps: int = 3  # the first is the warm-up (stage 3 records its unit order); the rest are timed
    nvme_path: str | None = None
    timeout_s: float = 3600.0


@dataclass
class StepProfile:
    """Where one rank-0 step goes, medians over the timed steps (seconds, bytes per step)."""

    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    gather_bytes: int  # all-gathered (stage 3's units) by this rank
    reduce_bytes: int  # reduce-scattered / all-reduced by this rank
    nvme_read_bytes: int
    nvme_write_bytes: int
    nvme_wait_s: float  # seconds the step blocked on NVMe requests
    param_read_bytes: int  # of nvme_read_bytes: gathers reading the parameter file
    param_write_bytes: int  # of nvme_write_bytes: the step writing updated parameters


@dataclass
class RunResult:
    """One real run of one rung."""

    rung: int
    ok: bool
    error: str = ""
    peak_rss_mib: list[float] = field(default_factory=list)  # per rank
    bytes_per_place: dict[str, int] = field(default_factory=dict)  # rank 0's engine accounting, by place
    profile: StepProfile | None = None
    final_loss: float | None = None


@dataclass
class SystemScale:
    system: str
    predicted: Prediction | None
    runs: list[RunResult]

    @property
    def largest(self) -> RunResult | None:
        return next((r for r in self.runs if r.ok), None)

    @property
    def prediction_held(self) -> bool | None:
        """True when the predicted rung trained; False when it failed (the search then walked down)."""
        if self.predicted is None or not self.runs:
            return None
        return self.runs[0].rung == self.predicted.rung and self.runs[0].ok


# ---- one rank ------------------------------------------------------------------------------------

def _watch_rss(limit_bytes: int) -> None:
    """Stop this rank the moment its RSS passes `limit_bytes` (a daemon thread)."""
    import psutil

    me = psutil.Process()

    def watch() -> None:
        while True:
            rss = me.memory_info().rss
            if rss > limit_bytes:
                print(f"[bench scale] rank RSS {rss / GIB:.2f} GiB passed its budget {limit_bytes / GIB:.2f} GiB; "
                      "stopping this run", flush=True)
                os._exit(OVER_BUDGET_EXIT)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True, name="rss-watch").start()


def _io_counters(engine: Any) -> dict[str, float]:
    """Cumulative NVMe and collective counters of this rank's engine."""
    stats = engine.update.stats()
    comm = engine.comm.stats.as_dict()
    param_io = engine.passes.param_io() if engine.passes is not None else ParamIO()  # stage 3's shard on NVMe
    return {"read": stats.get("nvme_read", {}).get("bytes", 0) + param_io.read_bytes,
            "write": stats.get("nvme_write", {}).get("bytes", 0) + param_io.written_bytes,
            "wait": stats.get("wait", {}).get("seconds", 0.0) + param_io.blocked_s,
            "gather": comm.get("all_gather", {}).get("bytes", 0) + comm.get("broadcast", {}).get("bytes", 0),
            "reduce": comm.get("reduce_scatter", {}).get("bytes", 0) + comm.get("all_reduce", {}).get("bytes", 0),
            "param_read": param_io.read_bytes, "param_write": param_io.written_bytes}


def _train(rank: int, world: int, system: str, model_cfg: GPTConfig, cfg: ScaleConfig) -> dict[str, Any]:
    import zerorun
    from zerorun import config
    from zerorun.runtime.comm.dist import init_distributed

    _watch_rss(cfg.budget.ram_bytes // world)
    init_distributed()
    from zerorun.runtime import host_allocator

    host_allocator.install()  # as the worker does: zero.host_memory applies
    torch.manual_seed(0)
    with zerorun.sharded_init() if system != "ddp" else contextlib.nullcontext():
        model = GPT(model_cfg)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        forward: Callable[..., Any] = wrapped
        backward: Callable[[torch.Tensor], Any] = lambda loss: loss.backward()  # noqa: E731

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=False)
        counters: Callable[[], dict[str, Any]] = lambda: {}  # noqa: E731
        places = {"cpu": 20 * sum(p.numel() for p in model.parameters())}
    else:
        nvme = [f"zero.offload_optimizer.nvme_path={cfg.nvme_path}", f"zero.offload_param.nvme_path={cfg.nvme_path}"] \
            if system.endswith("nvme") else []
        recipe = config.loads("script: bench", "<bench>", [*OVERRIDES[system], *nvme, "zero.wrap=[Block]",
                                                         "optimizer.lr=1e-4", "name=bench-scale"])
        engine = zerorun.initialize(model, None, recipe)
        forward, backward, step = engine, engine.backward, engine.step
        counters = lambda: _io_counters(engine)  # noqa: E731
        places = {}
        for (_, place), nbytes in engine.memory().entries.items():
            places[place] = places.get(place, 0) + nbytes
    rows: list[dict[str, float]] = []
    for i in range(cfg.steps):
        tokens = synthetic_tokens(model_cfg, cfg.budget.micro_batch, 0, rank, i)
        before, marks = counters(), [_now()]
        loss = forward(tokens)
        marks.append(_now())
        backward(loss)
        marks.append(_now())
        step()
        marks.append(_now())
        after = counters()
        row = {k: after[k] - before[k] for k in after}
        row.update(forward=marks[1] - marks[0], backward=marks[2] - marks[1], optimizer=marks[3] - marks[2])
        rows.append(row)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rows": rows[1:] or rows, "peak_rss_mib": rss, "places": places, "loss": float(loss.detach())}


def _now() -> float:
    dist.barrier()  # phases are timed on all ranks together
    return time.perf_counter()


def _profile(rows: list[dict[str, float]]) -> StepProfile:
    med = lambda key: statistics.median(r.get(key, 0) for r in rows)  # noqa: E731
    return StepProfile(med("forward") + med("backward") + med("optimizer"), med("forward"), med("backward"),
                       med("optimizer"), round(med("gather")), round(med("reduce")), round(med("read")), round(med("write")),
                       med("wait"), round(med("param_read")), round(med("param_write")))


# ---- the search ----------------------------------------------------------------------------------

def run_rung(system: str, rung: int, cfg: ScaleConfig) -> RunResult:
    """Train `rung` of the family with `system` in fresh rank processes; clean the NVMe files after."""
    layers, d_model, heads = cfg.family.shape(rung)
    model_cfg = GPTConfig(layers, d_model, heads, cfg.family.vocab, cfg.family.seq_len,
                          checkpoint="non-reentrant" if cfg.budget.checkpointing and system != "ddp" else "none")
    try:
        outs = run_ranks(_train, cfg.budget.world, (system, model_cfg, cfg), timeout=cfg.timeout_s)
    except RankFailure as exc:
        text = str(exc)
        reason = "over its RAM budget" if f"exit code {OVER_BUDGET_EXIT};" in text \
            else text.strip().splitlines()[-1][:300]
        return RunResult(rung, False, reason)
    finally:
        if cfg.nvme_path:
            shutil.rmtree(os.path.join(cfg.nvme_path, "bench-scale"), ignore_errors=True)
    return RunResult(rung, True, "", [o["peak_rss_mib"] for o in outs], outs[0]["places"], _profile(outs[0]["rows"]),
                     outs[0]["loss"])


def run(cfg: ScaleConfig, progress: Callable[[str], None] = print) -> list[SystemScale]:
    """For each system: predict the largest rung, train it, walk down while it fails."""
    results = []
    for system in cfg.systems:
        predicted = largest_fitting(system, cfg.family, cfg.budget, cfg.max_rung, cfg.max_params)
        scale = SystemScale(system, predicted, [])
        results.append(scale)
        if predicted is None:
            progress(f"{system}: not even rung 0 is predicted to fit the budget")
            continue
        tried: dict[int, bool] = {}
        while (rung := next_to_try(tried, predicted.rung)) is not None:
            p = predict(system, cfg.family, rung, cfg.budget)
            progress(f"{system}: rung {rung} ({p.params / 1e6:.0f}M params, predicted "
                     f"{p.ram_per_rank / GIB:.2f} GiB/rank, {p.disk_total / 1e9:.1f} GB files)...")
            started = time.perf_counter()
            result = run_rung(system, rung, cfg)
            scale.runs.append(result)
            tried[rung] = result.ok
            progress(f"{system}: rung {rung} {'trained' if result.ok else 'failed: ' + result.error} "
                     f"({time.perf_counter() - started:.0f} s)")
    return results


def as_json(cfg: ScaleConfig, results: list[SystemScale]) -> dict[str, Any]:
    return {"config": asdict(cfg),
            "results": [{"system": r.system, "predicted": asdict(r.predicted) if r.predicted else None,
                         "prediction_held": r.prediction_held, "runs": [asdict(x) for x in r.runs]} for r in results]}


def make_config(systems: str, max_rung: int, max_params: float | None, ram_gib: float | None,
                disk_gb: float | None, nvme_path: str | None, steps: int, family: Family,
                checkpointing: bool = True, timeout_s: float = 3600.0) -> ScaleConfig:
    """Validate the command's options into a ScaleConfig; budgets default to what the machine has free."""
    import psutil

    from zerorun.bench.scale_plan import SYSTEMS
    from zerorun.errors import ZerorunError

    chosen = tuple(s.strip() for s in systems.split(",") if s.strip())
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown or not chosen:
        raise ZerorunError(f"--systems: unknown or empty ({', '.join(unknown)}); choose from {', '.join(SYSTEMS)}.")
    if "zero3-nvme" in chosen:
        if not nvme_path or not os.path.isdir(nvme_path):
            raise ZerorunError(f"--nvme-path: zero3-nvme needs an existing directory on a real disk; got {nvme_path!r}.")
    if steps < 2 or max_rung < 0:
        raise ZerorunError("--steps must be at least 2 (one warm-up, one timed) and --max-rung at least 0.")
    if family.base_d_model % family.head_dim or family.d_step % family.head_dim:
        raise ZerorunError(f"the family's widths must be multiples of the head size {family.head_dim}.")
    available = psutil.virtual_memory().available
    ram = int(ram_gib * GIB) if ram_gib is not None else int(0.8 * available)
    if ram > available:
        raise ZerorunError(f"--ram-gib {ram_gib}: only {available / GIB:.1f} GiB of RAM is available now.")
    free = shutil.disk_usage(nvme_path).free if nvme_path else 0
    disk = int(disk_gb * 1e9) if disk_gb is not None else int(0.8 * free)
    if nvme_path and disk > free:
        raise ZerorunError(f"--disk-gb {disk_gb}: {nvme_path} has only {free / 1e9:.1f} GB free.")
    return ScaleConfig(chosen, family, Budget(ram, disk, checkpointing=checkpointing), max_rung,
                       int(max_params) if max_params else None, steps, nvme_path, timeout_s)


def render(cfg: ScaleConfig, results: list[SystemScale]) -> Any:
    """A rich table: per system, the largest rung trained, its bytes per place, peak RSS and where a step goes."""
    from rich.table import Table

    b = cfg.budget
    table = Table(title=f"largest GPT trained: budget {b.ram_bytes / GIB:.1f} GiB RAM (all ranks), "
                        f"{b.disk_bytes / 1e9:.0f} GB disk; {b.world} ranks x 1 thread, micro-batch {b.micro_batch}, "
                        f"fp32 AdamW, {cfg.steps} steps (first untimed)")
    for col in ("system", "predicted", "trained", "params", "RAM GiB/rank (engine)", "NVMe GB/rank",
                "peak RSS GiB/rank", "step s", "fwd / bwd / opt s", "gather / reduce GB", "NVMe read / write GB",
                "NVMe blocked s", "NVMe GB/s over the step"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in results:
        won = r.largest
        pred = f"r{r.predicted.rung} {r.predicted.params / 1e6:.0f}M" if r.predicted else "-"
        if won is None or won.profile is None:
            failed = "; ".join(f"r{x.rung}: {x.error}" for x in r.runs) or "not run"
            table.add_row(DESCRIPTIONS[r.system], pred, failed, *["-"] * 10)
            continue
        layers, d_model, _ = cfg.family.shape(won.rung)
        p, params = won.profile, predict(r.system, cfg.family, won.rung, b).params
        io_s = max(p.step_s, 1e-9)
        table.add_row(
            DESCRIPTIONS[r.system], pred, f"r{won.rung} ({layers}L d{d_model})" + ("" if r.prediction_held else " *"),
            f"{params / 1e6:.0f}M", f"{won.bytes_per_place.get('cpu', 0) / GIB:.2f}",
            f"{won.bytes_per_place.get('nvme', 0) / 1e9:.1f}", f"{max(won.peak_rss_mib) / 1024:.2f}",
            f"{p.step_s:.1f}", f"{p.forward_s:.1f} / {p.backward_s:.1f} / {p.optimizer_s:.1f}",
            f"{p.gather_bytes / 1e9:.2f} / {p.reduce_bytes / 1e9:.2f}",
            f"{p.nvme_read_bytes / 1e9:.2f} / {p.nvme_write_bytes / 1e9:.2f}", f"{p.nvme_wait_s:.1f}",
            f"{(p.nvme_read_bytes + p.nvme_write_bytes) / io_s / 1e9:.2f}")
    table.caption = "* the predicted rung failed and the search walked down; figures are rank 0's, per step"
    return table
