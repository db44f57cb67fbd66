"""`zerorun bench step --cluster`: ranks on emulated nodes, the bytes each node sends counted on its link."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from zerorun.bench import step
from zerorun.bench.cluster_spawn import run_ranks_on
from zerorun.bench.gpt import GPT, GPTConfig
from zerorun.cli import app

TINY = GPTConfig(layers=1, d_model=64, heads=2, vocab=512, seq_len=32)


@pytest.mark.slow
def test_ranks_on_two_nodes_train_alike_and_send_what_the_algorithm_needs_over_the_link(cluster):
    cfg = step.StepBenchConfig(TINY, micro_batch=1, world_size=2, rounds=1, warmup=1, steps=2,
                               systems=("ddp-fused", "zero2"), cluster=(2, 1))
    results = {r.system: r for r in step.run(cfg, progress=lambda line: None,
                                              spawn=lambda fn, args: run_ranks_on(cluster.cluster, 1, fn, args))}
    assert results["ddp-fused"].final_loss == pytest.approx(results["zero2"].final_loss, rel=1e-6)
    params = sum(p.numel() for p in GPT(TINY).parameters())
    ideal = step.ideal_link_mb("ddp-fused", params, 2)
    assert ideal == pytest.approx(params * 4 / 1e6)  # two nodes: each sends half the gradients, twice
    # the interface counts headers and the barriers too, never less than the algorithm's payload
    assert ideal <= results["ddp-fused"].link_mb < 1.3 * ideal, (results, ideal)
    assert ideal <= results["zero2"].link_mb < 2.0 * ideal, (results, ideal)


@pytest.mark.parametrize(("flags", "message"), [
    (["--cluster", "1x2"], "at least 2 nodes"),
    (["--cluster", "2by1"], "expected NODESxRANKS"),
    (["--cluster", "2x1", "--link", "fast"], "expected a rate such as 1gbit"),
])
def test_a_malformed_cluster_or_link_is_refused_before_anything_starts(flags, message):
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp", *flags])
    assert result.exit_code != 0 and message in result.output, result.output
