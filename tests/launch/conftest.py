from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.launch.launched import LaunchedJob, write_recipe


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., LaunchedJob]]:
    """`launch(script, args, **recipe_keys)`: start `zerorun launch` on a fresh recipe; cleaned up after."""
    jobs: list[LaunchedJob] = []

    def start(script: str, args: Sequence[str] = (), flags: Sequence[str] = (), **keys: object) -> LaunchedJob:
        job = LaunchedJob.start(write_recipe(tmp_path, script, args, **keys), *flags, cwd=tmp_path)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.cleanup()
