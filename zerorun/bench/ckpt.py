"""`zerorun bench ckpt`: what a checkpoint every N steps costs training, synchronous against background.

One engine per rank trains one model on one data stream; the run is cut into rounds, and each round
runs one window per mode, in an order rotated from round to round (`none, sync, async`, then
`sync, async, none`, ...), so a change of load on a shared machine falls on every mode alike
instead of on whichever ran last. A window is what `every` steps of training cost in that mode:

- `none`: `every` steps;
- `sync` (`checkpoint.async_save: false`): a save, then `every` steps;
- `async` (the default): a save, then `every` steps, then the wait for its commit. Everything the
  training loop waits for is inside the window: the snapshot, the next step's wait for the capture,
  the writer thread competing with the ranks for CPU, and (counted at the window's end) a write
  not finished when the next save would be due.

Per mode the report gives the median over rounds of the window time divided by `none`'s in the same
round (with the spread), the cost of one save (window minus `none`'s, same round), and the engine's
own `checkpoint` records (stall, background write time, bytes, snapshot size).

The issue's targets, printed with the figures: the async cost per save at most 10% of the synchronous
save's, and the step time with a save every `every` steps within 5% of `none`.

A mode `async-nice<N>` runs background saves with the writer thread at nice N (the default writer's
niceness is `checkpoint_async.WRITER_NICE`), to measure what the writer's priority changes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zerorun.bench.gpt import GPT, GPTConfig, synthetic_tokens
from zerorun.bench.spawn import run_ranks

MODES = ("none", "sync", "async")
_NICE_MODE = re.compile(r"^async-nice(\d{1,2})$")
STALL_TARGET = 0.10  # async cost per save / sync cost per save
STEP_TARGET = 1.05  # async window / none window


def valid_mode(mode: str) -> bool:
    return mode in MODES or bool(_NICE_MODE.match(mode) and int(mode[len("async-nice"):]) <= 19)


@dataclass(frozen=True)
class CkptBenchConfig:
    model: GPTConfig
    micro_batch: int = 2
    ranks: int = 2
    threads: int = 1
    stage: int = 2
    rounds: int = 3  # each round runs one window of `every` steps per mode
    every: int = 4
    directory: str = "/var/tmp"  # checkpoints are written under a fresh directory here, removed afterwards
    nvme_path: str | None = None  # offload the optimizer state to NVMe here
    modes: tuple[str, ...] = MODES


@dataclass
class Window:
    round: int
    mode: str
    seconds: float  # the whole window (save, steps, and for async the wait for the commit)
    step_s: list[float]  # rank 0's steps inside it
    save_s: float = 0.0  # save_checkpoint's own time on the training thread
    commit_wait_s: float = 0.0  # async: the wait for the commit after the steps


@dataclass
class BenchResult:
    windows: list[Window]
    saves: list[dict[str, Any]] = field(default_factory=list)  # rank 0's `checkpoint` records, timed saves only
    warmup_save: dict[str, Any] | None = None  # the untimed first async save (allocates the snapshot)

    def seconds(self, mode: str) -> dict[int, float]:
        return {w.round: w.seconds for w in self.windows if w.mode == mode}

    def ratios(self, mode: str) -> list[float]:
        """Per round: this mode's window over `none`'s."""
        none, mine = self.seconds("none"), self.seconds(mode)
        return [mine[r] / none[r] for r in sorted(mine) if r in none]

    def costs(self, mode: str) -> list[float]:
        """Per round: the seconds one save added to its window (this mode's window minus `none`'s)."""
        none, mine = self.seconds("none"), self.seconds(mode)
        return [mine[r] - none[r] for r in sorted(mine) if r in none]

    def records(self, mode: str) -> list[dict[str, Any]]:
        return [s for s in self.saves if s["bench_mode"] == mode]

    def mean_record(self, mode: str, key: str) -> float | None:
        values = [s[key] for s in self.records(mode)]
        return sum(values) / len(values) if values else None


def _set_mode(engine: Any, mode: str, default_nice: int) -> None:
    """Switch the engine's next save between synchronous and background (and the writer's niceness).
    The benchmark alone does this: the checkpointer reads `checkpoint.async_save` at each save."""
    from zerorun.runtime.checkpoint import background as checkpoint_async

    engine.recipe.checkpoint.async_save = mode != "sync"
    nice = _NICE_MODE.match(mode)
    checkpoint_async.WRITER_NICE = int(nice.group(1)) if nice else default_nice


def _train(rank: int, world: int, cfg: CkptBenchConfig, root: str) -> dict[str, Any]:
    import zerorun
    from zerorun import config
    from zerorun.runtime.checkpoint import background as checkpoint_async
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    from zerorun.runtime import host_allocator

    host_allocator.install()  # as the worker does: zero.host_memory applies
    default_nice = checkpoint_async.WRITER_NICE
    torch.manual_seed(0)
    # stage 3 builds the way a user of a large model does: never whole on any rank
    with zerorun.sharded_init() if cfg.stage == 3 else contextlib.nullcontext():
        model = GPT(cfg.model)
    keys = [f"zero.stage={cfg.stage}", "optimizer.lr=1e-4", "name=bench-ckpt", "checkpoint.resume=never",
            f"checkpoint.dir={root}", "checkpoint.every_steps=0", "checkpoint.keep_last=1", "zero.wrap=[Block]"]
    if cfg.nvme_path:
        keys += ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={cfg.nvme_path}"]
    engine = zerorun.initialize(model, None, config.loads("script: bench", "<bench>", keys))
    records: list[dict[str, Any]] = []
    current = ["warmup"]
    engine.runtime.events.subscribe_checkpoints(lambda r: records.append(dict(vars(r), bench_mode=current[0])))
    step = [0]

    def train_step() -> float:
        batch = synthetic_tokens(cfg.model, cfg.micro_batch, 0, rank, step[0])
        step[0] += 1
        started = time.perf_counter()
        engine.backward(engine(batch))
        engine.step()
        return time.perf_counter() - started

    train_step()
    _set_mode(engine, "async", default_nice)
    engine.save_checkpoint(block=True)  # untimed: the first background save allocates the snapshot
    windows = []
    for r in range(cfg.rounds):
        for mode in cfg.modes[r % len(cfg.modes):] + cfg.modes[:r % len(cfg.modes)]:
            current[0] = mode
            _set_mode(engine, mode, default_nice)
            windows.append(_window(engine, mode, r, cfg.every, train_step))
    return {"windows": [vars(w) for w in windows], "saves": [s for s in records if s["bench_mode"] != "warmup"],
            "warmup_save": next((s for s in records if s["bench_mode"] == "warmup"), None)}


def _window(engine: Any, mode: str, round_: int, every: int, train_step: Callable[[], float]) -> Window:
    started = time.perf_counter()
    save_s = commit_wait_s = 0.0
    if mode != "none":
        engine.save_checkpoint()
        save_s = time.perf_counter() - started
    steps = [train_step() for _ in range(every)]
    if mode != "none" and mode != "sync":
        waiting = time.perf_counter()
        engine.wait_checkpoint()
        commit_wait_s = time.perf_counter() - waiting
    return Window(round_, mode, time.perf_counter() - started, steps, save_s, commit_wait_s)


def run(cfg: CkptBenchConfig, progress: Callable[[str], None] = print) -> BenchResult:
    root = tempfile.mkdtemp(prefix="zerorun-bench-ckpt-", dir=cfg.directory)
    try:
        out = run_ranks(_train, cfg.ranks, (cfg, root), timeout=3 * 3600, threads=cfg.threads)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = BenchResult([Window(**w) for w in out["windows"]], out["saves"], out["warmup_save"])
    for w in result.windows:
        progress(f"round {w.round} {w.mode}: {w.seconds:.3f} s ({w.seconds / len(w.step_s):.3f} s/step)")
    return result


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def summary(result: BenchResult, modes: tuple[str, ...]) -> dict[str, Any]:
    """The targets' figures: per mode the window ratio to `none` and the cost of a save (median, min, max
    over rounds); the async cost per save over the synchronous one; whether each target is met."""
    out: dict[str, Any] = {"step_ratio": {}, "cost_per_save_s": {}}
    for mode in modes:
        if mode != "none":
            out["step_ratio"][mode] = _spread(result.ratios(mode))
            out["cost_per_save_s"][mode] = _spread(result.costs(mode))
    sync_cost, sync_stall = out["cost_per_save_s"].get("sync"), result.mean_record("sync", "stall_s")
    for mode in modes:
        if mode in ("none", "sync") or sync_cost is None or out["step_ratio"].get(mode) is None:
            continue
        cost, stall = out["cost_per_save_s"][mode]["median"], result.mean_record(mode, "stall_s")
        out.setdefault("targets", {})[mode] = {
            "cost_over_sync_cost": cost / sync_cost["median"],
            "engine_stall_over_sync_stall": stall / sync_stall if stall is not None and sync_stall else None,
            f"cost_per_save_within_{STALL_TARGET:.0%}_of_sync": cost <= STALL_TARGET * sync_cost["median"],
            f"step_within_{STEP_TARGET - 1:.0%}_of_none": out["step_ratio"][mode]["median"] <= STEP_TARGET}
    out["breakdown_s"] = {mode: breakdown(result, mode) for mode in modes if mode != "none"}
    return out


def breakdown(result: BenchResult, mode: str) -> dict[str, float] | None:
    """Where one save's cost goes (medians over rounds, rank 0): inside `save_checkpoint`, the optimizer
    step's wait for the capture, the wait for the commit after the window's steps, and the steps being
    slower than `none`'s in the same round otherwise (the writer thread competing for the cores)."""
    none = {w.round: w for w in result.windows if w.mode == "none"}
    windows = [w for w in result.windows if w.mode == mode and w.round in none]
    records = {w.round: r for w, r in zip([w for w in result.windows if w.mode == mode], result.records(mode))}
    parts: dict[str, list[float]] = {"in_save": [], "capture_wait": [], "commit_wait": [], "slower_steps": []}
    for w in windows:
        capture = max(0.0, records[w.round]["stall_s"] - w.save_s) if w.round in records else 0.0
        parts["in_save"].append(w.save_s)
        parts["capture_wait"].append(capture)
        parts["commit_wait"].append(w.commit_wait_s)
        parts["slower_steps"].append(sum(w.step_s) - sum(none[w.round].step_s) - capture)
    return {k: statistics.median(v) for k, v in parts.items()} if windows else None


def as_json(cfg: CkptBenchConfig, result: BenchResult) -> dict[str, Any]:
    return {"config": {"model": vars(cfg.model), "ranks": cfg.ranks, "stage": cfg.stage, "rounds": cfg.rounds,
                       "every": cfg.every, "nvme": cfg.nvme_path is not None, "micro_batch": cfg.micro_batch,
                       "modes": list(cfg.modes)},
            "windows": [vars(w) for w in result.windows], "saves": result.saves,
            "warmup_save": result.warmup_save, "summary": summary(result, cfg.modes)}


def render(cfg: CkptBenchConfig, result: BenchResult) -> Any:
    from rich.table import Table

    with torch.device("meta"):  # counted without allocating: the model can be as large as the host
        params = sum(p.numel() for p in GPT(cfg.model).parameters())
    where = f"optimizer on NVMe ({cfg.nvme_path})" if cfg.nvme_path else "optimizer in memory"
    title = (f"checkpoint every {cfg.every} steps: {params / 1e6:.1f}M params, stage {cfg.stage}, {where}, "
             f"{cfg.ranks} ranks, {cfg.rounds} rounds (rank 0)")
    table = Table(title=title, title_justify="left")
    for col in ("mode", "step (median)", "x none: median [min, max]", "cost/save", "stall/save (engine)",
                "write/save", "MiB/save/rank", "snapshot MiB/rank"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    facts = summary(result, cfg.modes)
    for mode in cfg.modes:
        per_step = [w.seconds / len(w.step_s) for w in result.windows if w.mode == mode]
        ratio, cost = facts["step_ratio"].get(mode), facts["cost_per_save_s"].get(mode)
        saved = result.mean_record(mode, "bytes")
        snapshot = max((s["snapshot_bytes"] for s in result.records(mode)), default=0)
        table.add_row(mode, _s(statistics.median(per_step)),
                      f"{ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}]" if ratio else "1.000",
                      _s(cost["median"]) if cost else "-", _s(result.mean_record(mode, "stall_s")),
                      _s(result.mean_record(mode, "write_s")) if mode != "sync" else "-",
                      f"{saved / 2**20:.0f}" if saved else "-", f"{snapshot / 2**20:.0f}" if snapshot else "-")
    return table


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.0f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


def default_directory() -> str:
    return "/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir()
