"""`zerorun bench step --baseline`: the second ratio column's plumbing (no timings: the runs are faked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zerorun.bench import step
from zerorun.cli import app

SECONDS = {"ddp": 2.0, "ddp-fused": 1.0, "zero1": 0.9}  # a fake step time per system


def _fake_run_ranks(fn, world, args, timeout, threads):
    system = args[0]
    live = None if system.startswith("ddp") else 10.5
    return [step.Sample([SECONDS[system]], [0.1], [0.2], [0.3], 100.0, 10.0, 1.5, live)]


def test_baseline_ratios_are_taken_against_the_chosen_system(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step, "run_ranks", _fake_run_ranks)
    out = tmp_path / "step.json"
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,ddp-fused,zero1", "--baseline", "ddp-fused",
                                      "--rounds", "2", "--json", str(out)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "x ddp-fused" in result.output and "x DDP" in result.output
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["zero1"]["ratio_to_ddp"] == 0.45 and rows["zero1"]["ratio_to_baseline"] == 0.9
    assert rows["ddp-fused"]["ratio_to_baseline"] == 1.0 and rows["ddp"]["ratio_to_baseline"] == 2.0
    assert rows["zero1"]["live_mib"] == 10.5 and rows["ddp"]["live_mib"] is None
    assert "10 (+5.0%)" in result.output  # live tensors against the model states


def test_the_census_counts_each_storage_once_and_sees_gradients_autograd_made() -> None:
    import torch

    model = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB of weight
    before = step.live_tensor_bytes(model)
    model(torch.ones(1, 1000)).sum().backward()  # a 4 MB gradient with no Python object yet
    views = [model.weight.data[i] for i in range(10)]  # views of the weight: no new storage
    extra = torch.empty(250_000)  # 1 MB of new storage
    grown = step.live_tensor_bytes(model) - before
    assert grown == 4_000_000 + 1_000_000, grown
    del views, extra


def test_default_baseline_is_ddp_and_adds_no_column(monkeypatch) -> None:
    monkeypatch.setattr(step, "run_ranks", _fake_run_ranks)
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,zero1", "--rounds", "1"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "x DDP" in result.output and "x ddp" not in result.output


def test_a_baseline_outside_the_systems_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,zero1", "--baseline", "ddp-fused"])
    assert result.exit_code != 0
    assert "--baseline" in result.output and "not among --systems" in result.output


def _fake_compiled_runs(fn, world, args, timeout, threads):
    """A compiled system's warm-up step holds its compile; its counts say what dynamo did."""
    system = args[0]
    compiled = "+compile" in system
    return [step.Sample([0.5 if compiled else 1.0], [0.1], [0.2], [0.2], 100.0, 10.0, 1.5, 10.0,
                        first_step_s=40.0 if compiled else 1.2, dynamo="3 graphs, 0 breaks" if compiled else None)]


def test_compile_adds_a_compiled_row_after_each_ddp_and_zerorun_system(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(step, "run_ranks", _fake_compiled_runs)
    out = tmp_path / "step.json"
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,zero3,zero3+compile-blocks", "--compile",
                                      "--rounds", "2", "--json", str(out)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["ddp", "ddp+compile", "zero3", "zero3+compile", "zero3+compile-blocks"]
    assert rows["zero3+compile"]["first_step_s"] == 40.0 and rows["zero3+compile"]["ratio_to_ddp"] == 0.5
    assert rows["zero3+compile"]["dynamo"] == "3 graphs, 0 breaks" and rows["zero3"]["dynamo"] is None
    assert "torch.compile(model)" in result.output and "torch.compile(each block)" in result.output
    assert "40.0 / 40.0" in result.output and "warm-up s" in result.output  # compile time apart from step time


def test_only_ddp_and_zerorun_systems_have_compiled_rows() -> None:
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "fsdp2+compile"])
    assert result.exit_code != 0 and "only ddp* and zero* systems have compiled rows" in result.output
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "zero9+compile"])
    assert result.exit_code != 0 and "unknown zero9+compile" in result.output


def test_muons_verdicts_compare_each_stage_with_its_adamw_row_t_ns_and_deepspeeds_muon_at_that_stage() -> None:
    from zerorun.bench.step_muon import muon_verdicts
    from zerorun.bench.step_results import NS_REFERENCE, StepBenchConfig, SystemResult

    def row(system: str, step_s: float) -> SystemResult:
        return SystemResult(system, step_s, None, None, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None)

    results = [row(NS_REFERENCE, 8.0), row("zero2@adamw", 2.0), row("zero2@muon", 6.5), row("zero3@adamw", 2.5),
               row("zero3@muon", 7.0), row("deepspeed2@muon", 13.0), row("deepspeed3@muon", 14.0),
               row("zero1@muon", 9.0)]  # no AdamW row at stage 1: no verdict for it
    lines = muon_verdicts(StepBenchConfig(optimizer="muon,adamw"), results)
    assert lines == ["T_NS (torch Muon.step(), one process) 8.00 s; split evenly over 2 ranks 4.00 s",
                     "zero2: Muon adds 4.50 s to AdamW's step = 1.12 x T_NS / 2; Muon step 6.50 s = 0.50 x "
                     "DeepSpeed's (13.00 s)",
                     "zero3: Muon adds 4.50 s to AdamW's step = 1.12 x T_NS / 2; Muon step 7.00 s = 0.50 x "
                     "DeepSpeed's (14.00 s)"]


def test_set_gives_every_zerorun_system_the_recipe_keys_and_names_them(monkeypatch, tmp_path: Path) -> None:
    seen = {}

    def fake(fn, world, args, timeout, threads):
        seen[args[0]] = args[1].overrides
        return _fake_run_ranks(fn, world, args, timeout, threads)

    monkeypatch.setattr(step, "run_ranks", fake)
    out = tmp_path / "step.json"
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,zero1", "--rounds", "1", "--set",
                                      "zero.prefetch_units=2", "--set", "zero.bucket_mb=8", "--json", str(out)],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert seen["zero1"] == ("zero.prefetch_units=2", "zero.bucket_mb=8")
    assert "zerorun with zero.prefetch_units=2, zero.bucket_mb=8" in " ".join(result.output.split())
    assert json.loads(out.read_text())["config"]["overrides"] == ["zero.prefetch_units=2", "zero.bucket_mb=8"]


def test_the_keys_reach_the_recipe_the_engine_is_built_from(monkeypatch) -> None:
    """_train's recipe: the system's keys, then --set's (a recipe built without them would run as before)."""
    import zerorun
    from zerorun.bench.shape import GPTConfig
    from zerorun.bench.step_results import StepBenchConfig
    from zerorun.runtime import host_allocator
    from zerorun.runtime.comm import dist as zdist

    class Built(Exception):
        pass

    def initialize(model, optimizer, recipe):
        raise Built(recipe.zero.prefetch_units, recipe.zero.stage, recipe.zero.wrap)

    monkeypatch.setattr(zdist, "init_distributed", lambda: None)  # built, not trained: no group is needed
    monkeypatch.setattr(host_allocator, "install", lambda: None)
    monkeypatch.setattr(zerorun, "initialize", initialize)
    cfg = StepBenchConfig(GPTConfig(1, 16, 2, 32, 8), systems=("zero1",), overrides=("zero.prefetch_units=2",))
    try:
        step._train(0, 1, "zero1", cfg)
    except Built as built:
        assert built.args == (2, 1, ["Block"])
    else:
        raise AssertionError("the engine was never built")


@pytest.mark.parametrize(("flags", "message"), [
    (["--set", "zero.prefetch_unit=2"], "--set zero.prefetch_unit=2: zero.prefetch_unit: unknown key; did you mean "
                                        "'prefetch_units'?"),
    (["--set", "zero.prefetch_units=two"], "zero.prefetch_units: expected auto or an integer"),
    (["--set", "zero.stage=2"], "the system zero3 sets zero.stage=3 itself"),
    (["--set", "precision.dtype=bf16"], "precision.dtype is --precision's to set"),
    (["--set", "prefetch"], "--set prefetch: expected KEY=VALUE"),
])
def test_set_refuses_what_would_not_run_as_asked(flags: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,zero3", *flags], env={"COLUMNS": "250"})
    assert result.exit_code != 0 and message in " ".join(result.output.split()), result.output


def test_set_without_a_zerorun_system_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,fsdp2", "--set", "zero.prefetch_units=2"],
                                env={"COLUMNS": "250"})
    assert result.exit_code != 0 and "none is among --systems (ddp, fsdp2)" in result.output, result.output
