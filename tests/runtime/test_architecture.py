"""docs/architecture.md lists the files one training step enters; this traces a real step and compares.

A step is one forward, one backward and one `engine.step()` after two warm-up steps (so lazy imports
and first-pass planning are behind us), on 2 gloo ranks, traced with `sys.setprofile` on rank 0's
training thread: every zerorun file (but the model's, bench/gpt.py) in which a Python function was called counts, however briefly.
The list in the guide is therefore counted by calls, not by narrative, and goes stale loudly.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.harness import run_ranks
from tests.runtime.reference import batch, tied_gpt

PACKAGE = Path(__file__).parents[2] / "zerorun"
DOC = Path(__file__).parents[2] / "docs" / "architecture.md"
STAGES = {"stage 2": ["zero.stage=2"], "stage 3": ["zero.stage=3", "zero.wrap=[Block]"]}


def _files_of_one_step(rank: int, world_size: int, overrides: list[str]) -> list[str]:
    import torch
    import torch._dynamo  # noqa: F401 - loaded or not depends on the torch version and on what ran before in this

    # process; the engine's forward looks for it (runtime/compiled.py) until it is: the steady state is "loaded"
    import zerorun
    from zerorun import config

    recipe = config.loads("script: train.py\n", "architecture.yaml", overrides)
    model = tied_gpt(0)  # the benchmark GPT, small: blocks for stage 3's units
    engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    for micro in range(2):
        engine.backward(engine(batch(0, rank, micro)))
        engine.step()
    entered: set[str] = set()
    root = str(PACKAGE) + "/"

    def profile(frame, event, arg) -> None:  # noqa: ANN001 - sys.setprofile's signature
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root) and not name.startswith(root + "bench/"):  # bench/: the model
            entered.add(name[len(root):])

    sys.setprofile(profile)
    try:
        engine.backward(engine(batch(0, rank, 2)))
        engine.step()
    finally:
        sys.setprofile(None)
    engine.wait_published()
    return sorted(entered)


def _documented(stage: str) -> list[str]:
    """The backticked paths of the guide's line `<stage> step, N files: ...` (relative to zerorun/)."""
    match = re.search(rf"^A {stage} step enters (\d+) files: (.+?)\.$", DOC.read_text(), re.M | re.S)
    assert match, f"docs/architecture.md has no line 'A {stage} step enters N files: `...`, ....'"
    files = re.findall(r"`([\w/]+\.py)`", match.group(2))
    assert int(match.group(1)) == len(files), f"the {stage} line says {match.group(1)} files and lists {len(files)}"
    return sorted(files)


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_the_guide_lists_the_files_a_step_enters(stage: str) -> None:
    traced = run_ranks(_files_of_one_step, 2, (STAGES[stage],))[0]
    documented = _documented(stage)
    assert traced == documented, (
        f"docs/architecture.md is stale for a {stage} step: entered but not listed {sorted(set(traced) - set(documented))}, "
        f"listed but not entered {sorted(set(documented) - set(traced))}; traced: {traced}")
