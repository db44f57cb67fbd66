"""A disk that fills up during a background save loses nothing.

`checkpoint.dir` is on a small ext4 file system of its own (a loop-mounted image: root only, skipped
without it, always unmounted). Two ranks train 2 steps and save step-2; rank 0 then fills the disk;
the save of step-4 fails in the writer thread. Every rank must learn of it as an error naming the
rank, a file and the errno; `latest` must still name step-2; the next engine on that directory
removes the partial save, resumes from step-2 and trains exactly as the run that never failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.test_checkpoint_async import _engine, _train
from zerorun.runtime.checkpoint.files import tags


@pytest.fixture
def small_disk():
    """A 8 MiB ext4 file system mounted on a fresh directory; unmounted and removed afterwards."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to loop-mount a small file system")
    work = Path(tempfile.mkdtemp(prefix="zerorun-small-disk-"))
    image, mount = work / "disk.img", work / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    mounted = False
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
        if subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True).returncode:
            pytest.skip("loop devices are not available here")
        mounted = True
        yield mount
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _fill(directory: Path, leave: int) -> None:
    """Write into `directory` until the file system is full, then free `leave` bytes (room for the
    save's directory, not for its files)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_full_case(rank: int, world: int, disk: str) -> dict:
    import torch.distributed as dist

    from zerorun.errors import ZerorunError

    root = Path(disk) / "ckpt"
    keys = ["zero.stage=2", f"checkpoint.dir={root}", "launch.timeout_s=30"]
    whole = _engine(keys)
    _train(whole, rank, 0, 2)
    reference = [loss_of(whole, rank, m) for m in range(2, 4)]
    del whole
    engine = _engine(keys)
    _train(engine, rank, 0, 2)
    engine.save_checkpoint(block=True)
    dist.barrier()
    if rank == 0:
        _fill(Path(disk), leave=6144)
    dist.barrier()
    _train(engine, rank, 2, 2)
    engine.save_checkpoint()
    try:
        engine.wait_checkpoint()
        error = None
    except ZerorunError as exc:
        error = str(exc)
    dist.barrier()
    latest, partial = (root / "latest").read_text(), (root / ".tmp-step-4").is_dir()
    dist.barrier()
    if rank == 0:
        (Path(disk) / "filler").unlink()
    dist.barrier()
    resumed = _engine(keys)  # removes the partial save (rank 0), then loads latest
    resumed.load_checkpoint()
    dist.barrier()
    step, cleaned = resumed.global_step, not (root / ".tmp-step-4").exists()
    return {"error": error, "latest": latest, "partial": partial, "step": step, "cleaned": cleaned,
            "reference": reference, "resumed": [loss_of(resumed, rank, m) for m in range(2, 4)]}


def loss_of(engine, rank: int, micro: int) -> float:
    from tests.runtime.reference import batch

    loss = engine(batch(0, rank, micro))
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.slow
def test_a_full_disk_during_a_background_save_keeps_latest_names_the_error_and_resumes_exactly(small_disk):
    results = run_ranks(_disk_full_case, 2, (str(small_disk),))
    errors = [r["error"] for r in results if r["error"] is not None]
    assert errors, "the failed save is an error on the ranks whose write failed"
    for error in errors:
        assert "checkpoint step-4 not saved" in error and "rank " in error, error
    own = [e for e in errors if "No space left on device" in e]
    assert own and all("ENOSPC, errno 28" in e and ".tmp-step-4/" in e for e in own), errors
    for r in results:
        assert r["latest"] == "step-2\n" and r["partial"]
        assert r["step"] == 2 and r["cleaned"]
    assert tags(small_disk / "ckpt") == ["step-2"]
    # resumed at step 2, the losses of steps 3 and 4 are those of the run that never failed
    assert torch.tensor([r["resumed"] for r in results]).equal(torch.tensor([r["reference"] for r in results]))
