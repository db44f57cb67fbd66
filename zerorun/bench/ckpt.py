"""`zerorun bench ckpt`: what a checkpoint every N steps costs training, synchronous against background.

One run trains the same model, data and recipe three times in turn (`none`: no checkpoint; `sync`:
`checkpoint.async_save: false`; `async`: the default), saving every `every` optimizer steps into a
fresh directory, and reports per mode:

- the mean step time over the timed steps (the save's stall included: a synchronous save inside
  the step that triggered it, a background save's snapshot and its capture wait in the steps after),
  and its ratio to `none`;
- per save: the stall (the seconds the training loop waited, from the engine's `checkpoint`
  telemetry), the background write time and the bytes written per rank;
- the async stall as a share of the synchronous save's time.

The issue's targets: async stall per save at most 10% of the synchronous save, and the step time
with a save every 4 steps within 5% of `none`. Modes run one after another on a shared machine:
compare ratios within one run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zerorun.bench.gpt import GPT, GPTConfig, synthetic_tokens
from zerorun.bench.spawn import run_ranks

MODES = ("none", "sync", "async")


@dataclass(frozen=True)
class CkptBenchConfig:
    model: GPTConfig
    micro_batch: int = 2
    ranks: int = 2
    threads: int = 1
    stage: int = 2
    steps: int = 12  # timed optimizer steps, after one warm-up step
    every: int = 4
    directory: str = "/var/tmp"  # checkpoints are written under a fresh directory here, removed afterwards
    nvme_path: str | None = None  # offload the optimizer state to NVMe here
    modes: tuple[str, ...] = MODES


@dataclass
class ModeResult:
    mode: str
    step_s: list[float] = field(default_factory=list)  # rank 0's timed steps
    saves: list[dict[str, Any]] = field(default_factory=list)  # rank 0's `checkpoint` records
    final_wait_s: float = 0.0  # waiting for the last save's commit after the loop

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)

    def mean(self, key: str) -> float | None:
        values = [s[key] for s in self.saves]
        return sum(values) / len(values) if values else None


def _train(rank: int, world: int, mode: str, cfg: CkptBenchConfig, root: str) -> dict[str, Any]:
    import zerorun
    from zerorun import config
    from zerorun.runtime import events
    from zerorun.runtime.dist import init_distributed

    init_distributed()
    torch.manual_seed(0)
    model = GPT(cfg.model)
    keys = [f"zero.stage={cfg.stage}", "optimizer.lr=1e-4", "name=bench-ckpt", "checkpoint.resume=never"]
    if cfg.nvme_path:
        keys += ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={cfg.nvme_path}"]
    if mode != "none":
        keys += [f"checkpoint.dir={root}", f"checkpoint.every_steps={cfg.every}", "checkpoint.keep_last=1",
                 f"checkpoint.async_save={mode == 'async'}"]
    engine = zerorun.initialize(model, None, config.loads("script: bench", "<bench>", keys))
    records: list[Any] = []
    events.subscribe_checkpoints(records.append)
    times = []
    for i in range(1 + cfg.steps):
        batch = synthetic_tokens(cfg.model, cfg.micro_batch, 0, rank, i)
        started = time.perf_counter()
        engine.backward(engine(batch))
        engine.step()
        times.append(time.perf_counter() - started)
    started = time.perf_counter()
    engine.wait_checkpoint()
    return {"step_s": times[1:], "saves": [vars(r) for r in records], "final_wait_s": time.perf_counter() - started}


def run(cfg: CkptBenchConfig, progress: Callable[[str], None] = print) -> list[ModeResult]:
    results = []
    for mode in cfg.modes:
        root = tempfile.mkdtemp(prefix=f"zerorun-bench-ckpt-{mode}-", dir=cfg.directory)
        try:
            out = run_ranks(_train, cfg.ranks, (mode, cfg, root), timeout=3600, threads=cfg.threads)[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        result = ModeResult(mode, out["step_s"], out["saves"], out["final_wait_s"])
        progress(f"{mode}: step {result.mean_step_s:.3f} s, {len(result.saves)} saves, stall "
                 f"{_s(result.mean('stall_s'))}, write {_s(result.mean('write_s'))}")
        results.append(result)
    return results


def summary(results: list[ModeResult]) -> dict[str, Any]:
    """The two targets' figures: async stall / sync save time, and each mode's step time / none's."""
    by = {r.mode: r for r in results}
    out: dict[str, Any] = {}
    if "none" in by:
        out["step_ratio"] = {r.mode: r.mean_step_s / by["none"].mean_step_s for r in results}
    if "sync" in by and "async" in by and by["sync"].saves and by["async"].saves:
        out["async_stall_over_sync_save"] = by["async"].mean("stall_s") / by["sync"].mean("stall_s")
    return out


def as_json(cfg: CkptBenchConfig, results: list[ModeResult]) -> dict[str, Any]:
    return {"config": {"model": vars(cfg.model), "ranks": cfg.ranks, "stage": cfg.stage, "steps": cfg.steps,
                       "every": cfg.every, "nvme": cfg.nvme_path is not None, "micro_batch": cfg.micro_batch},
            "modes": [{"mode": r.mode, "mean_step_s": r.mean_step_s, "step_s": r.step_s, "saves": r.saves,
                       "final_wait_s": r.final_wait_s} for r in results],
            "summary": summary(results)}


def render(cfg: CkptBenchConfig, results: list[ModeResult]) -> Any:
    from rich.table import Table

    params = sum(p.numel() for p in GPT(cfg.model).parameters()) if cfg.model.layers <= 48 else None
    where = f"optimizer on NVMe ({cfg.nvme_path})" if cfg.nvme_path else "optimizer in memory"
    title = (f"checkpoint every {cfg.every} steps: {params / 1e6:.1f}M params, " if params else "") + \
        f"stage {cfg.stage}, {where}, {cfg.ranks} ranks, {cfg.steps} timed steps (rank 0)"
    table = Table(title=title, title_justify="left")
    for col in ("mode", "step (mean)", "x none", "saves", "stall/save", "write/save", "MiB/save/rank",
                "snapshot MiB/rank"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    ratios = summary(results).get("step_ratio", {})
    for r in results:
        saved = r.mean("bytes")
        snapshot = max((s["snapshot_bytes"] for s in r.saves), default=0)
        table.add_row(r.mode, _s(r.mean_step_s), f"{ratios[r.mode]:.3f}" if r.mode in ratios else "-",
                      str(len(r.saves)), _s(r.mean("stall_s")), _s(r.mean("write_s")),
                      f"{saved / 2**20:.0f}" if saved else "-", f"{snapshot / 2**20:.0f}" if snapshot else "-")
    return table


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def default_directory() -> str:
    return "/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir()
