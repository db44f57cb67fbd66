"""`zerorun bench step --optimizer muon`: DeepSpeed's own Muon beside zerorun's, and the bound they are held to.

Newton-Schulz is real work: on the benchmark GPT's matrices torch's `Muon.step()` takes seconds in one
process, several times a micro-batch's forward and backward. So what a stage may add to AdamW's step
is that work split evenly over the ranks and nothing else: T_NS / N, where T_NS is `newton_schulz`,
torch's `Muon.step()` over the same matrices (the recipe's muon split, DeepSpeed's) alone in one
process with the ranks' threads. `muon_verdicts` prints the measured multiple of it under the table.
"""

from __future__ import annotations

import resource
import time
from typing import Sequence

import torch

from zerorun.bench.gpt import GPT
from zerorun.bench.peers import optimizer_keys
from zerorun.bench.step_results import NS_REFERENCE, Sample, StepBenchConfig, SystemResult, split_optimizer


def newton_schulz(rank: int, world: int, cfg: StepBenchConfig) -> Sample:
    """T_NS: torch's `Muon.step()` over the matrices the recipe's muon gives it (DeepSpeed's split) of the bench's
    GPT, alone in one process with the ranks' threads, on the GPU where the ranks have one (the engine steps its
    owned matrices there); as a Sample whose steps are the optimizer's."""
    from zerorun import config
    from zerorun.runtime.optim.recipe_optimizers import from_recipe

    torch.manual_seed(0)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model = GPT(cfg.model).to(device)
    muon = from_recipe(config.loads("script: bench", "<bench>", optimizer_keys(cfg)).optimizer, model)[0]
    assert isinstance(muon, torch.optim.Muon), type(muon)
    for group in muon.param_groups:
        for p in group["params"]:
            p.grad = torch.randn_like(p)
    times = []
    for _ in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        muon.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    timed = times[cfg.warmup:]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return Sample(timed, [0.0] * len(timed), [0.0] * len(timed), timed, rss, 0.0, float("nan"), None)


def muon_verdicts(cfg: StepBenchConfig, results: Sequence[SystemResult]) -> list[str]:
    """Per stage with both a Muon and an AdamW row: what Muon adds to the step against T_NS / ranks (the most the
    work split evenly can cost), and its step against DeepSpeed's Muon at that stage, where it ran."""
    by = {r.system: r for r in results}
    if NS_REFERENCE not in by:
        return []
    ns = by[NS_REFERENCE].step_s
    lines = [f"T_NS (torch Muon.step(), one process) {ns:.2f} s; split evenly over {cfg.world_size} ranks "
             f"{ns / cfg.world_size:.2f} s"]
    for r in results:
        system, optimizer = split_optimizer(r.system, cfg.optimizer)
        adamw = by.get(f"{system}@adamw") or (by.get(system) if cfg.optimizer == "adamw" else None)
        if optimizer != "muon" or not system.startswith("zero") or adamw is None:
            continue
        added = r.step_s - adamw.step_s
        line = (f"{system}: Muon adds {added:.2f} s to AdamW's step = {added / (ns / cfg.world_size):.2f} x "
                f"T_NS / {cfg.world_size}")
        stage = system.removeprefix("zero")  # zero2 -> 2: DeepSpeed's row at the same stage is deepspeed2
        peer = by.get(f"deepspeed{stage}@muon")
        if peer is not None and stage in ("2", "3"):
            line += f"; Muon step {r.step_s:.2f} s = {r.step_s / peer.step_s:.2f} x DeepSpeed's ({peer.step_s:.2f} s)"
        lines.append(line)
    return lines
