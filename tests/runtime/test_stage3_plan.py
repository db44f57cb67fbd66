"""Stage 3 says what it shards: unknown `zero.wrap` classes are refused, the default finds the model's
layers, a plan with no units is reported, and the quick start at stage 3 shards (and says into how many units)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.harness import run_ranks
from tests.launch.launched import REPO, LaunchedJob
from zerorun.bench.gpt import GPT, GPTConfig
from zerorun.errors import ZerorunError
from zerorun.runtime.stage3.module_units import wrapped_modules

QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def _launch(tmp_path: Path, *sets: str) -> tuple[int, str]:
    flags = [f for s in ("train.steps=2", *sets) for f in ("--set", s)]
    job = LaunchedJob.start(QUICKSTART, *flags, cwd=tmp_path)
    try:
        return job.wait(timeout=240), job.output
    finally:
        job.cleanup()


@pytest.mark.slow  # a real launch; the plan checks on two ranks stay fast
def test_a_misspelled_wrap_class_stops_the_launch_and_names_it(tmp_path: Path) -> None:
    code, output = _launch(tmp_path, "zero.stage=3", "zero.wrap=[Blok]")
    assert code != 0, output
    assert "zero.wrap: no module of class 'Blok' (did you mean 'Block'?) in GPT" in output, output
    assert "Block, Embedding, LayerNorm, Linear, ModuleList" in output, output
    assert "step    0" not in output  # refused before training


@pytest.mark.slow  # a real launch
def test_the_quick_start_at_stage_3_shards_its_layers_and_says_into_how_many_units(tmp_path: Path) -> None:
    code, output = _launch(tmp_path, "zero.stage=3")
    assert code == 0, output
    assert "ZeRO stage 3 (4 units)" in output, output  # one per Block, in the script's banner
    # and said by zerorun itself, whatever the script prints
    assert "zerorun: stage 3: 4 units (Block; 793,088 parameters gathered around their use), 139,520 in the " \
        "root unit, 0 persistent" in output, output
    assert "ZerorunWarning" not in output, output
    # 0.93M parameters on 2 ranks: stage 3 holds 16/N = 8 bytes per parameter (7.1 MiB) at rest,
    # stage 2 holds 4 + 12/N = 10 (8.9 MiB); before units were found automatically it held 10.7
    states = float(re.search(r"done: 2 steps, model states ([\d.]+) MiB", output).group(1))
    assert states < 7.5, output


def _quick_gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(layers=3, d_model=32, heads=2, vocab=64, seq_len=8))


def test_an_empty_wrap_list_makes_the_models_layers_units() -> None:
    names = [name for name, _ in wrapped_modules(_quick_gpt(), [], auto_numel=10**9)]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    stack = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    assert [name for name, _ in wrapped_modules(stack, [], auto_numel=10**9)] == ["0", "2.0", "2.1"]
    big = nn.ModuleDict({"a": nn.Linear(100, 100)})
    plain = nn.Module()
    plain.big, plain.small = nn.Linear(100, 100), nn.Linear(2, 2)
    assert [name for name, _ in wrapped_modules(plain, [], auto_numel=1000)] == ["big"]  # size decides outside lists
    assert [name for name, _ in wrapped_modules(big, [], auto_numel=10**9)] == ["a"]


def test_wrap_names_that_match_no_module_class_are_refused_with_the_classes_there() -> None:
    model = _quick_gpt()
    with pytest.raises(ZerorunError, match=r"no module of class 'Blok' \(did you mean 'Block'\?\) in GPT; its module "
                                           r"classes are Block, Embedding, LayerNorm, Linear, ModuleList"):
        wrapped_modules(model, ["Block", "Blok"], auto_numel=1)
    with pytest.raises(ZerorunError, match=r"'GPT' in GPT \(the model itself is always the root unit\)"):
        wrapped_modules(model, ["GPT"], auto_numel=1)
    outermost = [name for name, _ in wrapped_modules(model, ["Block", "Linear"], auto_numel=1)]
    assert outermost == ["blocks.0", "blocks.1", "blocks.2", "head"]  # a Linear inside a Block is not a unit of its own


def _plan(rank: int, world: int, overrides: list[str]) -> tuple[list[str], int]:
    import zerorun
    from zerorun import config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = config.loads("script: t.py", "t.yaml", ["zero.stage=3", *overrides])
        engine = zerorun.initialize(_quick_gpt(), None, recipe)
    engine.destroy()
    assert engine.num_parameters() == sum(p.numel() for p in _quick_gpt().parameters())  # not the released ones
    return [str(w.message) for w in caught if w.category.__name__ == "ZerorunWarning"], engine.memory().units


def test_stage3_without_units_warns_once_with_the_numbers_and_what_to_set() -> None:
    (warned, units), (other_rank, _) = run_ranks(_plan, 2, (["zero.param_persistence_threshold=100000"],))
    assert units == 0 and other_rank == []
    assert len(warned) == 1, warned
    total = sum(p.numel() for p in _quick_gpt().parameters())
    assert f"made no units: of {total:,} trainable parameters, 0 are in the root unit" in warned[0]
    assert f"{total:,} are persistent" in warned[0] and "Set zero.wrap" in warned[0], warned[0]
    assert "zero.param_persistence_threshold" in warned[0]
    (warned, units), _ = run_ranks(_plan, 2, ([],))
    assert units == 3 and warned == []
