"""A setting the script and the recipe both give (its autocast's dtype and precision; its loop's length and
train.steps): one warning at run time where the two disagree, naming which wins (runtime/script_settings.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.harness import run_ranks
from zerorun import config
from zerorun.runtime import script_settings
from zerorun.runtime.script_settings import ScriptSettings

CPU = torch.device("cpu")


def _settings(*overrides: str, text: str = "script: t.py\n") -> ScriptSettings:
    recipe = config.loads(text, "r.yaml", list(overrides))
    return script_settings.watch(recipe, torch.float32, rank=0)


def test_an_autocast_of_another_dtype_than_precision_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    settings = _settings()
    with caplog.at_level(logging.WARNING, "zerorun"):
        settings.forward(0, CPU)  # no autocast: nothing to say
        with torch.autocast("cpu", dtype=torch.bfloat16):
            settings.forward(0, CPU)
            settings.forward(1, CPU)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("zerorun: warning: the script's autocast runs the forward in bf16 "
                                                 "while precision.dtype is fp32: the parameters, gradients")
    quiet = script_settings.watch(config.loads("script: t.py\nprecision: bf16\n"), torch.bfloat16, rank=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, "zerorun"), torch.autocast("cpu", dtype=torch.bfloat16):
        quiet.forward(0, CPU)  # the two agree
    assert caplog.records == []


def test_a_loop_past_the_train_steps_the_user_gave_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    given = _settings(text="script: t.py\ntrain: {steps: 3}\n")
    with caplog.at_level(logging.WARNING, "zerorun"):
        for step in range(6):
            given.forward(step, CPU)
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == ("zerorun: warning: the script goes on to step 4, past train.steps: its own loop decides how many "
                    "steps run, but train.steps = 3 (r.yaml:2) sets the progress total. Set train.steps to the "
                    "script's count (docs/coming-from-ddp.md).")


def test_train_steps_left_at_its_default_says_nothing_unless_the_recipes_schedule_ends_there(
        caplog: pytest.LogCaptureFixture) -> None:
    default = _settings()
    schedule = _settings("scheduler.type=WarmupDecayLR", "scheduler.warmup_num_steps=2")
    with caplog.at_level(logging.WARNING, "zerorun"):
        default.forward(500, CPU)  # a script counting its own loop (item 4: no total either)
        assert caplog.records == []
        schedule.forward(100, CPU)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "train.steps = 100 (its default) sets the end of the recipe's WarmupDecayLR schedule" in said


def _autocast_forward(rank: int, world: int) -> list[str]:
    import zerorun

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zerorun").addHandler(handler)
    engine = zerorun.initialize(torch.nn.Linear(4, 2), None, config.loads("script: t.py\ntrain: {steps: 1}\n"))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # as nanoGPT's `ctx` with --dtype=bfloat16
            loss = engine(torch.randn(3, 4)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return [line for line in said if line.startswith("zerorun: warning: the script")]


def test_the_engine_asks_at_every_forward() -> None:
    """Issue 57: the script's --dtype / the recipe's precision, its max_iters / train.steps, said nowhere."""
    (said,) = run_ranks(_autocast_forward, 1)
    assert len(said) == 2 and "autocast runs the forward in bf16" in said[0] and "goes on to step 2" in said[1]
