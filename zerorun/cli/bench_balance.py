"""`zerorun bench balance`, one command of `cli/bench.py`'s group kept in a module of its own."""

from __future__ import annotations

from typing import Annotated

import typer

from zerorun.bench.shape import BENCHMARK, GPTConfig
from zerorun.errors import ZerorunError


def bench_balance(
    ranks: Annotated[str, typer.Option(help="Comma-separated rank counts to plan for.")] = "2,3,4,8",
    layers: Annotated[int, typer.Option(help="GPT layers.")] = BENCHMARK.layers,
    d_model: Annotated[int, typer.Option(help="GPT width.")] = BENCHMARK.d_model,
    vocab: Annotated[int, typer.Option(help="Vocabulary size.")] = BENCHMARK.vocab,
    threads: Annotated[int, typer.Option(min=1, help="CPU threads of the timed steps.")] = 1,
    repeats: Annotated[int, typer.Option(min=1, help="Timed steps per matrix shape (the median is kept).")] = 3,
) -> None:
    """How evenly stage 3 spreads Muon's Newton-Schulz over the ranks: each matrix shape timed alone, summed per
    rank as the engine's plan places them."""
    from rich.console import Console

    from zerorun.bench import balance

    try:
        worlds = [int(r) for r in ranks.split(",") if r.strip()]
    except ValueError:
        worlds = []
    if not worlds or min(worlds) < 1:
        raise ZerorunError(f"--ranks: {ranks!r}; give rank counts of 1 or more, comma-separated (e.g. 2,3,4,8).")
    cfg = GPTConfig(layers, d_model, BENCHMARK.heads, vocab, BENCHMARK.seq_len)
    seconds, spreads = balance.run(cfg, worlds, threads, repeats)
    Console(width=200).print(balance.render(cfg, seconds, spreads, threads))
