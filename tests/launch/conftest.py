from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.launch.launched import LaunchedJob, write_recipe
from tests.launch.sshd import PrivateSSHD, find_sshd


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


@pytest.fixture(scope="module")
def launch_once(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LaunchedJob]]:
    """`launch_once(script, args, **recipe_keys)`: a finished launch, shared by the module's tests that ask for
    the same one (a reference run several tests compare with): each launch costs seconds of start-up."""
    done: dict[str, LaunchedJob] = {}

    def run(script: str, args: Sequence[str] = (), **keys: object) -> LaunchedJob:
        key = json.dumps([script, list(args), keys], sort_keys=True)
        if key not in done:
            directory = tmp_path_factory.mktemp("shared-run")
            job = LaunchedJob.start(write_recipe(directory, script, args, **keys), cwd=directory)
            job.wait(timeout=300)
            done[key] = job
        return done[key]

    yield run
    for job in done.values():
        job.cleanup()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateSSHD]:
    """A private sshd on 127.0.0.1 and 127.0.0.2 (two "hosts"); skips when sshd is not installed."""
    if find_sshd() is None:
        pytest.skip("sshd is not installed (CI installs openssh-server)")
    server = PrivateSSHD.start(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def launch_ssh(launch: Callable[..., LaunchedJob], sshd: PrivateSSHD, tmp_path: Path) -> Callable[..., LaunchedJob]:
    """`launch_ssh(script, args, nproc=2, ...)`: a launch on both loopback "hosts", every node over SSH."""
    hosts = tmp_path / "hosts"

    def start(script: str, args: Sequence[str] = (), nproc: int = 2, flags: Sequence[str] = (),
              **keys: object) -> LaunchedJob:
        hosts.write_text("".join(f"{host} slots={nproc}\n" for host in sshd.hosts))
        keys.setdefault("launch", {"kill_grace_s": 1.0, "transport": "ssh"})
        return launch(script, args, flags=["--hostfile", str(hosts), *flags], ssh=sshd.recipe_section(), **keys)

    return start
