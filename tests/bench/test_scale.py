"""`zerorun bench scale`: the family, the prediction and the search as pure functions; one tiny real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from zerorun import estimate as est
from zerorun.bench.gpt import GPT, GPTConfig
from zerorun.bench.scale_plan import GIB, Budget, Family, gpt_params, largest_fitting, next_to_try, predict
from zerorun.cli import app
from zerorun.runtime.offload.placement import Place

TINY = ["--base-layers", "1", "--base-d-model", "64", "--d-step", "64", "--layer-step", "1", "--vocab", "128",
        "--seq-len", "16"]


def test_the_family_starts_at_the_standard_model_and_grows_width_and_depth_together() -> None:
    family = Family()
    assert family.shape(0) == (12, 768, 12)
    assert family.shape(5) == (22, 2048, 32)
    sizes = [gpt_params(*family.shape(r)[:2], family.vocab, family.seq_len)[0] for r in range(9)]
    assert sizes[0] == 97_737_216  # the standard benchmark model (docs/benchmarks.md)
    assert all(b > 1.25 * a for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize("layers,d_model,heads", [(12, 768, 12), (3, 320, 5), (2, 64, 1)])
def test_parameter_count_matches_the_model_built_on_meta(layers: int, d_model: int, heads: int) -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(layers, d_model, heads, vocab=300, seq_len=17))
    total, block, root = gpt_params(layers, d_model, 300, 17)
    assert total == sum(p.numel() for p in model.parameters())
    assert block == sum(p.numel() for p in model.blocks[0].parameters())
    assert root == total - layers * block


def test_ddp_needs_twenty_bytes_a_parameter_and_no_disk() -> None:
    family, budget = Family(), Budget(12 * GIB, 45 * 10**9)
    small, large = predict("ddp", family, 0, budget), predict("ddp", family, 1, budget)
    slope = (large.ram_per_rank - small.ram_per_rank) / (large.params - small.params)
    assert 20 <= slope < 21.5  # 16 B of model states + 4 B of DDP buckets; activations (no checkpointing) grow too
    assert small.disk_total == 0


def test_nvme_puts_sixteen_bytes_a_parameter_on_disk_and_far_less_in_ram_than_cpu_offload() -> None:
    family, budget = Family(), Budget(12 * GIB, 45 * 10**9)
    nvme, cpu = predict("zero3-nvme", family, 5, budget), predict("zero3-cpu", family, 5, budget)
    assert nvme.disk_total == pytest.approx(16 * nvme.params, rel=1e-6)  # master, two moments, fp32 params
    assert cpu.disk_total == 0
    # RAM keeps the fp32 gradient shard (4/N) against 20/N with everything on the CPU, but NVMe adds its
    # ring (3 files x 3 slots of 64 MiB), the parameter file's bounce tile, two queued parameter writes
    # (a tile each) and two bounce buffers of a unit's fp32 shard (one gathering, one read ahead)
    _, block, _ = gpt_params(*Family().shape(5)[:2], 8192, 128)
    ring = 12 * 64 * 2**20 + 2 * 4 * block // 2
    assert cpu.ram_per_rank - nvme.ram_per_rank == pytest.approx(16 * nvme.params / 2 - ring, abs=2)


def test_largest_fitting_is_the_last_rung_under_both_budgets() -> None:
    family = Family()
    roomy = Budget(12 * GIB, 45 * 10**9)
    assert largest_fitting("ddp", family, roomy, 8).rung == 1
    assert largest_fitting("zero3-nvme", family, roomy, 8).rung == 6
    disk_bound = Budget(12 * GIB, 10 * 10**9)  # rung 3 needs 8.6 GB of files, rung 4 12.8
    assert largest_fitting("zero3-nvme", family, disk_bound, 8).rung == 3
    assert largest_fitting("zero3-nvme", family, roomy, 8, max_params=600e6).rung == 3
    assert largest_fitting("zero3-nvme", family, roomy, 2).rung == 2
    assert largest_fitting("ddp", family, Budget(GIB, 0), 8) is None


def test_prediction_agrees_with_estimate_for_the_model_states() -> None:
    family, budget = Family(), Budget(100 * GIB, 10**12)
    total, block, root = gpt_params(*family.shape(2)[:2], family.vocab, family.seq_len)
    states = est.placed_states(est.ModelShape(total, block, root), 2, 3, "fp32", "cpu", "cpu")
    cpu = predict("zero3-cpu", family, 2, budget)
    assert cpu.ram_per_rank > sum(states[Place.HOST].values()) + sum(states[Place.DEVICE].values())


def test_search_verifies_the_prediction_then_walks_down_and_stops_at_the_first_success() -> None:
    assert next_to_try({}, 4) == 4
    assert next_to_try({4: False}, 4) == 3
    assert next_to_try({4: False, 3: False}, 4) == 2
    assert next_to_try({4: False, 3: True}, 4) is None
    assert next_to_try({4: True}, 4) is None
    assert next_to_try({0: False}, 0) is None


@pytest.mark.slow
def test_bench_scale_runs_a_tiny_family_for_every_system(direct_io_dir: Path, tmp_path: Path) -> None:
    out, disk = tmp_path / "scale.json", direct_io_dir / "disk"
    disk.mkdir()
    result = CliRunner().invoke(app, ["bench", "scale", "--nvme-path", str(disk), "--max-rung", "1",
                                      "--ram-gib", "3", "--disk-gb", "1", "--json", str(out), *TINY])
    assert result.exit_code == 0, result.output
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"ddp", "zero3-cpu", "zero3-nvme"}
    for row in rows.values():
        assert row["predicted"]["rung"] == 1 and row["prediction_held"], row
        run = row["runs"][0]
        assert run["ok"] and run["profile"]["step_s"] > 0 and len(run["peak_rss_mib"]) == 2
    nvme = rows["zero3-nvme"]["runs"][0]
    assert nvme["bytes_per_place"]["nvme"] > 0 and nvme["profile"]["nvme_write_bytes"] > 0
    assert nvme["profile"]["param_read_bytes"] > 0  # gathers read the parameter file
    assert rows["zero3-cpu"]["runs"][0]["profile"]["nvme_read_bytes"] == 0
    assert list(disk.iterdir()) == []  # the offload files are gone


def test_bench_scale_refuses_bad_options(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "scale", "--systems", "zero9"])
    assert result.exit_code != 0 and "--systems: unknown" in result.output
    result = runner.invoke(app, ["bench", "scale", "--systems", "zero3-nvme", "--nvme-path", str(tmp_path / "no")])
    assert result.exit_code != 0 and "--nvme-path" in result.output
    result = runner.invoke(app, ["bench", "scale", "--systems", "ddp", "--ram-gib", "100000"])
    assert result.exit_code != 0 and "--ram-gib" in result.output
