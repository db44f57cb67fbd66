"""Real launches against hostile input and shared machines: large recipes, a second job on the same paths,
forged telemetry. Each test names what happened before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch.launched import BIG_RECIPE_ENV, recipe_files_shown


@pytest.mark.slow
def test_a_recipe_over_128_kib_launches_through_a_private_file(launch, tmp_path: Path):
    job = launch("show_recipe.py", nproc_per_node=2, env=BIG_RECIPE_ENV)
    assert job.wait(timeout=120) == 0, job.output
    path = recipe_files_shown(job, ranks=2)
    assert job.job_id in path and not Path(path).exists()  # the job's own place, removed at the end
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_second_job_on_the_same_run_name_or_checkpoint_dir_is_refused_naming_the_first(launch, tmp_path: Path):
    first = launch("stubborn.py", name="shared", checkpoint={"dir": str(tmp_path / "ckpt")})
    first.wait_for("ready", count=2)
    job_id = first.job_id
    for keys in ({"name": "shared"}, {"name": "other", "checkpoint": {"dir": str(tmp_path / "ckpt")}}):
        second = launch("stubborn.py", **keys)
        assert second.wait(timeout=60) == 2, second.output
        refused = "\n".join(second.stderr)
        assert f"is in use by job {job_id} (launcher pid {first.proc.pid} on " in refused, second.output
        assert "nothing was started" in refused and second.job_id is None
    first.send(2)
    assert first.wait() == 130
    again = launch("stubborn.py", ["--fail-rank", "0"], name="shared", checkpoint={"dir": str(tmp_path / "ckpt")})
    assert again.wait(timeout=120) != 2, again.output  # released at the end: the next job runs
    assert not any("in use by" in line for line in again.stderr)


@pytest.mark.slow
def test_a_stale_lock_of_a_killed_launcher_is_named_and_taken_over(launch, tmp_path: Path):
    first = launch("stubborn.py", name="stale")
    first.wait_for("ready", count=2)
    job_id = first.job_id
    first.proc.kill()  # SIGKILL: the lock file still names the job, the kernel dropped its flock
    first.wait()
    second = launch("allreduce.py", name="stale")
    assert second.wait(timeout=120) == 0, second.output
    assert any(f"taking over the lock of job {job_id} (launcher pid {first.proc.pid} on " in line
               for line in second.stderr), second.output


@pytest.mark.slow
def test_two_jobs_of_one_name_on_one_nvme_disk_keep_their_own_offload_files(tmp_path: Path, direct_io_dir: Path):
    import signal

    from tests.launch.launched import LaunchedJob, write_recipe

    tiny = str(Path(__file__).resolve().parents[1] / "telemetry" / "scripts" / "tiny_train.py")
    keys = {"name": "same", "nproc_per_node": 2, "train": {"steps": 100_000},
            "zero": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(direct_io_dir)}}}
    jobs = []
    try:
        for where in ("a", "b"):  # two working directories: two runs/ trees, one NVMe disk
            (tmp_path / where).mkdir()
            recipe = write_recipe(tmp_path / where, tiny, ["--step-delay", "0.05"], **keys)
            jobs.append(LaunchedJob.start(recipe, cwd=tmp_path / where))
        owners = lambda: sorted({p.relative_to(direct_io_dir).parts[0] for p in direct_io_dir.rglob("*.bin")})  # noqa: E731
        jobs[0].wait_until(lambda: len(owners()) == 2 and len(list(direct_io_dir.rglob("*.bin"))) == 12,
                           "both jobs' offload files", timeout=180)
        assert owners() == sorted(job.job_id for job in jobs)
        jobs[0].send(signal.SIGINT)
        assert jobs[0].wait() == 130, jobs[0].output
        left = [p for p in direct_io_dir.rglob("*.bin")]
        assert len(left) == 6 and all(jobs[1].job_id in str(p) for p in left)  # the other job's are untouched
        assert jobs[1].proc.poll() is None, jobs[1].output
        jobs[1].send(signal.SIGINT)
        assert jobs[1].wait() == 130, jobs[1].output
        assert list(direct_io_dir.rglob("*.bin")) == []
    finally:
        for job in jobs:
            job.cleanup()


OOM_SCRIPT = """
import os, sys, time
import torch.distributed as dist
rank = dist.get_rank()
print(f"pid {os.getpid()}", flush=True)
time.sleep(1.5)  # a telemetry sample or two (the rank's RSS)
if rank == 1:
    with open(sys.argv[1], "w") as procs:  # into a memory cgroup of 200 MB, then past it
        procs.write(str(os.getpid()))
    hog = b"x" * (600 << 20)
dist.barrier()
"""


def _memory_cgroup(limit_bytes: int):
    """A fresh memory cgroup under this process's own (v1 or v2), its `cgroup.procs`; None if none can be made."""
    import os

    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, limit = Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes"
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            base, limit = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"
        else:
            continue
        group = base / f"zerorun-test-oom-{os.getpid()}"
        try:
            group.mkdir()
            (group / limit).write_text(str(limit_bytes))
            return group
        except OSError:
            if group.exists():
                group.rmdir()
    return None


@pytest.mark.slow
def test_an_out_of_memory_kill_is_named_with_the_ranks_last_rss(launch, tmp_path: Path):
    import pytest

    group = _memory_cgroup(200 << 20)
    if group is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a writable cgroup file system)")
    try:
        script = tmp_path / "oom.py"
        script.write_text(OOM_SCRIPT)
        job = launch(str(script), [str(group / "cgroup.procs")], nproc_per_node=2, telemetry={"interval_s": 0.2})
        assert job.wait(timeout=120) == 137, job.output
        final = next(line for line in reversed(job.stderr) if line.startswith(f"zerorun: job {job.job_id} stopped: "))
        assert "rank 1 on localhost failed (out of memory: killed by the kernel's OOM killer (SIGKILL); its last " \
               "RSS was " in final, job.output
        assert job.leftovers() == []
    finally:
        group.rmdir()


SHM_SCRIPT = """
import os, signal
# what a rank killed while the ranks were mapping a shared-memory segment leaves (named as the runtime names it)
path = f"/dev/shm/zerorun-{os.environ['ZERORUN_JOB_ID']}-{os.getpid()}-setup"
with open(path, "wb") as segment:
    segment.write(bytes(1 << 20))
print(f"left {path}", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_segment_a_killed_rank_left_in_dev_shm_is_removed_when_the_job_ends(launch, tmp_path: Path):
    script = tmp_path / "shm.py"
    script.write_text(SHM_SCRIPT)
    job = launch(str(script), nproc_per_node=1)
    assert job.wait(timeout=120) == 137, job.output
    (left,) = [line.rsplit(" ", 1)[1] for line in job.stdout if " left /dev/shm/" in line]
    assert not Path(left).exists(), job.output
    assert job.leftovers() == []
