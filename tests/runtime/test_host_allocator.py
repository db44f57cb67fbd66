"""zero.host_memory is applied by the process that installs it (the worker), around each engine's setup."""

from __future__ import annotations

from tests.harness import run_ranks


def _modes_set(rank: int, world: int, install: bool, overrides: list[str]) -> list[str]:
    import torch

    import zerorun
    from zerorun import config
    from zerorun.runtime import host_allocator

    modes: list[str] = []
    host_allocator.set_host_allocator = modes.append  # type: ignore[assignment]  # record, do not tune
    if install:
        host_allocator.install()
    recipe = config.loads("script: t.py", "t.yaml", overrides)
    zerorun.initialize(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), None, recipe)
    return modes


def test_the_installed_tuning_follows_the_engine_setup_and_nothing_tunes_without_it() -> None:
    stage3 = ["zero.stage=3", "zero.wrap=[Linear]"]
    assert run_ranks(_modes_set, 2, (True, stage3))[0] == ["lean", "fast"]  # lean for setup, then training's
    assert run_ranks(_modes_set, 2, (True, ["zero.stage=2", "zero.host_memory=lean"]))[0] == ["lean", "lean"]
    assert run_ranks(_modes_set, 2, (True, ["zero.stage=2"]))[0] == []  # glibc's defaults: nothing asked
    assert run_ranks(_modes_set, 2, (False, stage3))[0] == []  # building an engine tunes nothing by itself


def test_the_worker_installs_it() -> None:
    import inspect

    from zerorun.launch import worker

    assert "host_allocator.install()" in inspect.getsource(worker.run_script)
