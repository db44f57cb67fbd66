"""Directory locks on their own: taken, refused while held, released, stale ones named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerorun.errors import LaunchError
from zerorun.launch.ownership import LOCK_NAME, lock_directory


def test_a_held_lock_refuses_a_second_taker_and_is_free_again_once_released(tmp_path: Path):
    first = lock_directory(tmp_path / "ckpt", "checkpoint.dir", "job-1")
    assert oct((tmp_path / "ckpt" / LOCK_NAME).stat().st_mode & 0o777) == "0o600"
    with pytest.raises(LaunchError, match=r"checkpoint.dir: \S+ckpt is in use by job job-1 \(launcher pid \d+ on "):
        lock_directory(tmp_path / "ckpt", "checkpoint.dir", "job-2")
    first.release()
    second = lock_directory(tmp_path / "ckpt", "checkpoint.dir", "job-2")
    assert second.stale is None  # released cleanly: nothing stale to name
    second.release()


def test_a_lock_file_left_by_a_dead_launcher_is_stale_and_named(tmp_path: Path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"job_id": "gone", "host": "h", "pid": 123, "since": 0.0}))
    lock = lock_directory(tmp_path, "checkpoint.dir", "job-3")  # nobody holds its flock: the holder died
    assert lock.stale is not None and lock.stale.describe().startswith("job gone (launcher pid 123 on h, since ")
    lock.release()


def test_a_checkpoint_dir_the_launcher_cannot_create_is_noted_not_refused(tmp_path: Path):
    from zerorun import config
    from zerorun.launch.hostfile import Node
    from zerorun.launch.ownership import claim_paths
    from zerorun.launch.plan import MachineFacts, plan

    recipe = config.from_dict({"script": "/x/t.py", "name": "n", "checkpoint": {"dir": "/proc/zerorun-no/ckpt"}})
    claim = claim_paths(plan(recipe, [Node("a", (0,))], "job-4", 1, MachineFacts(2, "py")), runs_dir=tmp_path)
    try:
        assert [lock.directory for lock in claim.locks] == [tmp_path / "n"]  # runs/<name>/ is locked
        assert claim.notes[0].startswith("checkpoint.dir: cannot create /proc/zerorun-no/ckpt/.zerorun-lock") and \
            claim.notes[0].endswith("not locked: another job using it would not be noticed")
    finally:
        claim.release()


def full_tmpfs(directory: Path) -> bool:
    """A 64 KiB tmpfs at `directory`, filled to the last byte; False where it cannot be mounted (not root)."""
    import shutil
    import subprocess

    directory.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                                        str(directory)], capture_output=True).returncode != 0:
        return False
    try:
        with open(directory / "filler", "wb") as filler:
            while True:
                filler.write(b"\0" * 4096)
                filler.flush()
    except OSError:
        pass
    return True


@pytest.mark.parametrize("disk", ["injected", "tmpfs"])
def test_on_a_full_disk_the_lock_holds_and_its_missing_record_is_said_once(tmp_path: Path, disk: str,
                                                                           monkeypatch: pytest.MonkeyPatch):
    """Issue 57: a full runs/ disk ended the launch with a raw OSError (errno 28) from writing the lock's record."""
    import errno
    import os
    import subprocess

    runs = tmp_path / "runs"
    if disk == "injected":
        def full(fd: int, data: bytes, offset: int) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwrite", full)
    elif not full_tmpfs(runs):
        pytest.skip("cannot mount a size-limited file system here (needs root): the injected writer stands in")
    try:
        lock = lock_directory(runs / "demo", "run name 'demo' (telemetry)", "job-5")
        assert lock.unrecorded is not None and "No space left on device" in lock.unrecorded
        assert "locked for this job" in lock.unrecorded
        with pytest.raises(LaunchError, match="is in use by another job"):  # the guard holds, unnamed
            lock_directory(runs / "demo", "run name 'demo' (telemetry)", "job-6")
        lock.release()
    finally:
        if disk == "tmpfs":
            subprocess.run(["umount", "-l", str(runs)], capture_output=True)
