"""`zerorun bench balance`: every Muon matrix priced once and counted on exactly one rank (tiny GPT here; no
timing asserts)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from zerorun.bench import balance
from zerorun.bench.gpt import GPT
from zerorun.bench.shape import GPTConfig
from zerorun.cli import app

TINY = GPTConfig(layers=3, d_model=64, heads=4, vocab=128, seq_len=16)


def test_each_rank_count_splits_the_same_seconds_over_its_ranks() -> None:
    seconds, spreads = balance.run(TINY, [1, 2, 3], repeats=1)
    matrices = [tuple(p.shape) for name, p in GPT(TINY).named_parameters() if p.ndim >= 2]
    assert set(seconds) == set(matrices) and all(s > 0 for s in seconds.values())
    total = sum(seconds[shape] for shape in matrices)  # each matrix on exactly one rank, at every rank count
    assert [s.ranks for s in spreads] == [1, 2, 3] and [len(s.seconds) for s in spreads] == [1, 2, 3]
    for spread in spreads:
        assert sum(spread.seconds) == pytest.approx(total, rel=1e-9)
        assert spread.measured >= 1.0 and spread.modelled >= 1.0
    assert spreads[0].measured == spreads[0].modelled == 1.0


def test_the_command_prints_a_row_per_rank_count_and_refuses_a_bad_list() -> None:
    runner = CliRunner()
    tiny = ["--layers", "2", "--d-model", "64", "--vocab", "128", "--repeats", "1"]
    result = runner.invoke(app, ["bench", "balance", "--ranks", "2,3", *tiny])
    assert result.exit_code == 0, result.output
    assert "busiest / mean" in result.output and "one step, s:" in result.output
    refused = runner.invoke(app, ["bench", "balance", "--ranks", "two", *tiny])
    assert refused.exit_code != 0 and "--ranks: 'two'" in refused.output
