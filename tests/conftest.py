"""Fixtures shared across the test packages."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from zerorun.runtime.offload.nvme import MEMORY_FILESYSTEMS, filesystem_type

WORKERS = 3  # test files run on this many pytest-xdist workers by default (docs/benchmarks.md: the suite's time)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Unless `-n` says otherwise, the test files are shared among `WORKERS` processes (pytest-xdist, the test extra):
    much of the suite waits on launched jobs (their start, heartbeats, timeouts, a rank's sleep) rather than
    computing, and on a 2-core machine two workers kept 1.85 cores busy: a third fills the waits (the whole suite
    854 s against 911 s on two, quiet, one after the other; the development tier 125 s against 133). A file stays
    on one worker (`--dist loadfile`): its module fixtures (a reference launch, a Slurm cluster) are made
    once. `-n 0` runs in this process, as a debugger needs; without pytest-xdist (a GPU machine's bare pytest) the
    suite runs here too."""
    if getattr(config.option, "numprocesses", 0) is None and not os.environ.get("PYTEST_XDIST_WORKER") \
            and not config.getoption("usepdb", False):
        config.option.numprocesses = WORKERS
        if config.option.dist == "no":
            config.option.dist = "loadfile"


if os.environ.get("PYTEST_XDIST_WORKER"):
    # execnet starts pytest-xdist's workers with COLUMNS=80 and LINES=24, which a plain run does not have: rich would
    # take them for a terminal's, and the tests of what zerorun prints where no terminal is (120 columns) would not
    # see what users see
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


def _direct_io_works(directory: Path) -> bool:
    probe = directory / f".probe-{uuid.uuid4().hex}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
    except OSError:
        return False
    probe.unlink()
    return True


@pytest.fixture
def direct_io_dir(tmp_path: Path) -> Path:
    """An empty directory on a real disk (O_DIRECT works, not tmpfs): tmp_path, else one under /var/tmp."""
    if filesystem_type(tmp_path) not in MEMORY_FILESYSTEMS and _direct_io_works(tmp_path):
        yield tmp_path
        return
    for base in ("/var/tmp", tempfile.gettempdir(), str(Path(__file__).resolve().parents[1] / "build")):
        if os.path.isdir(base) and os.access(base, os.W_OK) and filesystem_type(Path(base)) not in MEMORY_FILESYSTEMS \
                and _direct_io_works(Path(base)):
            directory = Path(tempfile.mkdtemp(prefix="zerorun-test-", dir=base))
            yield directory
            shutil.rmtree(directory, ignore_errors=True)
            return
    pytest.skip("no directory on a real disk accepts O_DIRECT here (tmp_path and /var/tmp are tmpfs or refuse it)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, the runtime, every test module) is frozen out of the garbage collector's
    reach (`tests/frozen_imports.py` says why) before the first test runs: the full collections the rank-thread
    tests set off in this process no longer walk it. `python -m pytest -n 0` of test_stage3, test_engine_precision
    and test_collectives: 47.2-48.5 s of machine CPU before, 42.4-44.4 frozen."""
    from zerorun.launch.warm import freeze_imports

    freeze_imports()
