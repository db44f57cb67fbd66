"""`zerorun bench balance`: how evenly the owner way spreads Muon's Newton-Schulz over the ranks at stage 3.

Each distinct shape among the benchmark GPT's Muon matrices (the recipe's muon split, DeepSpeed's) is timed
alone: torch's `Muon.step()` over one parameter of that shape, on this machine's cores. A rank's seconds are
the sum over the matrices the stage 3 plan gives it, planned on the meta device as the engine plans it
(`plan_stage3`, with the bench's `zero.wrap: [Block]` and the recipe's buckets). No rank runs: the plan is
a pure function of the shapes and the rank count, so one measurement prices every rank count.

    zerorun bench balance --ranks 2,3,4,8
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from zerorun.bench.gpt import GPT
from zerorun.bench.shape import GPTConfig


@dataclass(frozen=True)
class Spread:
    """One rank count's Newton-Schulz per rank: measured seconds, and the busiest rank over the mean by the plan's
    own cost model (`ownership.matrix_cost`)."""

    ranks: int
    seconds: tuple[float, ...]  # per rank
    modelled: float

    @property
    def measured(self) -> float:
        """The busiest rank's seconds over the mean."""
        return max(self.seconds) * self.ranks / sum(self.seconds)


def run(cfg: GPTConfig, worlds: Sequence[int], threads: int = 1, repeats: int = 3) -> tuple[dict[tuple, float],
                                                                                          list[Spread]]:
    """Each Muon shape's step seconds (median of `repeats`), and the spread at each rank count in `worlds`."""
    from zerorun import config
    from zerorun.runtime.optim.recipe_optimizers import from_recipe
    from zerorun.runtime.ownership import Balance, matrix_cost
    from zerorun.runtime.stage3.module_units import plan_stage3
    from zerorun.runtime.stage_setup import numel

    recipe = config.loads("script: bench", "<bench balance>", ["optimizer.type=muon", "zero.stage=3"])
    with torch.device("meta"):
        model = GPT(cfg)
    muon = from_recipe(recipe.optimizer, model)[0]
    assert isinstance(muon, torch.optim.Muon), type(muon)
    matrices = [p for group in muon.param_groups for p in group["params"]]
    options = {k: v for k, v in muon.param_groups[0].items() if k != "params"}
    torch.set_num_threads(threads)
    seconds = {shape: _step_seconds(shape, options, repeats) for shape in sorted({tuple(p.shape) for p in matrices})}
    taken = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in taken]
    zero = recipe.zero
    spreads = []
    for world in worlds:
        balance = Balance(matrix_cost, world)
        plan = plan_stage3(model, [matrices, rest], ["Block"], zero.param_persistence_threshold, numel(zero.bucket_mb),
                           numel(zero.allgather_bucket_mb), world, torch.float32, [balance, None])
        per_rank = [0.0] * world
        for unit in plan.units:
            for i, shape in enumerate(unit.shapes if unit.group == 0 else []):
                per_rank[unit.layout.owner(i)] += seconds[tuple(shape)]
        spreads.append(Spread(world, tuple(per_rank), max(balance.loads) * world / sum(balance.loads)))
    return seconds, spreads


def _step_seconds(shape: tuple, options: dict, repeats: int) -> float:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape))
    param.grad = torch.randn(shape)
    step = torch.optim.Muon([param], **options)
    step.step()  # warm-up: the momentum buffer, the first allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def render(cfg: GPTConfig, seconds: dict[tuple, float], spreads: list[Spread], threads: int):
    from rich.table import Table

    table = Table(title=f"Muon's Newton-Schulz per rank at stage 3: GPT {cfg.layers}L d{cfg.d_model} vocab {cfg.vocab}, "
                        f"{len(seconds)} matrix shapes timed alone ({threads} thread(s)), zerorun's placement",
                  title_justify="left")
    for column in ("ranks", "seconds per rank", "busiest / mean, measured", "busiest / mean, cost model"):
        table.add_column(column, justify="right")
    for spread in spreads:
        table.add_row(str(spread.ranks), " ".join(f"{s:.2f}" for s in spread.seconds), f"{spread.measured:.3f}",
                      f"{spread.modelled:.3f}")
    table.caption = "one step, s: " + ", ".join(f"{'x'.join(map(str, shape))} {s:.3f}" for shape, s in seconds.items())
    return table
