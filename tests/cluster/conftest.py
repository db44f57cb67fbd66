from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.cluster.nodes import ClusterWithSSH
from tests.launch.launched import LaunchedJob, write_recipe
from tests.launch.sshd import find_sshd
from zerorun.bench.cluster import unavailable_reason


def cluster_skip_reason() -> str | None:
    reason = unavailable_reason()
    if reason is None and find_sshd() is None:
        reason = "sshd is not installed (CI installs openssh-server)"
    return reason


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterWithSSH]:
    """Two emulated nodes joined by a 1 Gbit/s link, an sshd on each; skips where this cannot be built."""
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(reason)
    with ClusterWithSSH.start(tmp_path_factory.mktemp("cluster"), nodes=2, link="1gbit") as built:
        yield built


@pytest.fixture
def launch_on_cluster(cluster: ClusterWithSSH, tmp_path: Path) -> Iterator[Callable[..., LaunchedJob]]:
    """`launch_on_cluster(script, args, nproc=1, **recipe_keys)`: `zerorun launch` on node 0, every node over SSH."""
    jobs: list[LaunchedJob] = []

    def start(script: str, args: Sequence[str] = (), nproc: int = 1, **keys: object) -> LaunchedJob:
        hosts = cluster.hostfile(tmp_path / "hosts", slots=nproc)
        keys.setdefault("launch", {"kill_grace_s": 1.0, "transport": "ssh"})
        recipe = write_recipe(tmp_path, script, args, ssh=cluster.recipe_section(), **keys)
        job = LaunchedJob.start(recipe, "--hostfile", str(hosts), cwd=tmp_path, prefix=cluster.launcher_prefix())
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.cleanup()
