"""An engine lives in a runtime (zerorun/runtime/context.py) and shares nothing with engines of another.

Rank threads are the sharpest case: before the runtime held them, the step listeners, saves in flight, live engines
and segments were module globals, so a rank thread's listener heard its peers' steps and `settle_all` reached into
another rank's engines. Here each rank thread builds its engine in its own runtime and hears only its own.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from tests.harness import run_threads, seeded
from zerorun.runtime import context
from zerorun.runtime.context import Runtime


def _listen_and_train(rank: int, world: int) -> dict:
    import zerorun
    from zerorun import config

    runtime = context.current()
    heard: list[tuple[int, int]] = []
    runtime.events.subscribe(lambda stats: heard.append((stats.step, stats.samples)))
    with seeded(0):
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    engine = zerorun.initialize(model, None, config.loads("script: t.py", "t.yaml", ["zero.stage=2"]))
    for step in range(2):
        inputs = torch.randn(rank + 1, 6, generator=torch.Generator().manual_seed(step))  # rank r: r + 1 samples
        engine.backward(engine(inputs).pow(2).mean())
        engine.step()
    return {"heard": heard, "same runtime": engine.runtime is runtime and engine.comm.runtime is runtime,
            "live": len(runtime.engines.live()), "mine": runtime.engines.live() == [engine]}


def test_each_rank_thread_hears_only_its_own_engines_steps() -> None:
    results = run_threads(_listen_and_train, 2)
    for rank, result in enumerate(results):
        assert result["heard"] == [(1, rank + 1), (2, rank + 1)], result  # shared listeners: 4 steps each
        assert result["same runtime"] and result["live"] == 1 and result["mine"], result


class _Part:
    made = 0

    def __init__(self) -> None:
        _Part.made += 1
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_part_is_made_once_per_runtime_and_closed_with_it() -> None:
    one, two = Runtime(), Runtime()
    made = _Part.made
    assert one.part(_Part) is one.part(_Part) and one.part(_Part) is not two.part(_Part)
    assert _Part.made == made + 2
    part = one.part(_Part)
    one.close()
    assert part.closed and one.part(_Part) is not part  # closed, and made again when asked again


def test_using_makes_a_runtime_current_inside_and_closes_it_after() -> None:
    outer = context.current()
    inner = Runtime()
    part = inner.part(_Part)
    with context.using(inner) as current:
        assert current is inner and context.current() is inner
    assert context.current() is outer and part.closed


def test_a_thread_starts_with_a_runtime_of_its_own() -> None:
    mine = context.current()
    seen: list[Runtime] = []
    thread = threading.Thread(target=lambda: seen.extend([context.current(), context.current()]))
    thread.start()
    thread.join()
    assert seen[0] is seen[1] and seen[0] is not mine
