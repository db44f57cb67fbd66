"""A worker killed in the middle of a checkpoint save leaves the previous checkpoint intact.

Real 2-worker launches of `scripts/train_checkpointed.py` (a checkpoint every 2 steps; background saves,
where the kill hits the writer thread while training goes on, and synchronous ones). The test-only
variable ZERORUN_CHECKPOINT_CRASH makes one rank SIGKILL itself at a point inside the save of
step 4: after writing its shard (the other rank may be writing too), or after rank 0 wrote the
manifest but before the checkpoint was renamed into place. The job must end with no process left,
`latest` must still name step-2, which must load; a new launch resumes from it (auto), cleans the
crashed save up and ends exactly where an uninterrupted run ends. The same holds when the launcher
itself is SIGKILLed while a background write is in flight (its node supervisors end the workers).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from zerorun.runtime.checkpoint import files as checkpoint_format
from zerorun.runtime.checkpoint import tools as checkpoint_tools
from zerorun.runtime.checkpoint.background import SLOW_ENV
from zerorun.runtime.checkpoint.sharded import CRASH_ENV

TEARDOWN_LIMIT_S = 15.0


def _keys(ckpt_dir, async_save=True, **env):
    return dict(train={"steps": 6, "seed": 3}, zero={"stage": 2}, env=env, launch={"kill_grace_s": 1.0},
                checkpoint={"dir": str(ckpt_dir), "every_steps": 2, "async_save": async_save})


def _final(job) -> list[str]:
    return sorted(re.findall(r"rank \d final loss \S+ checksum \S+", "\n".join(job.stdout)))


@pytest.mark.parametrize("rank,point,async_save", [(1, "shard", True), (0, "manifest", True), (1, "shard", False),
                                                   (0, "manifest", False)])
@pytest.mark.slow
def test_worker_killed_during_a_save_leaves_the_previous_checkpoint_loadable_and_latest(launch, launch_once, tmp_path,
                                                                                          rank, point, async_save):
    ckpt = tmp_path / "ckpt"
    crashed = launch("train_checkpointed.py", **_keys(ckpt, async_save, **{CRASH_ENV: f"{rank}:{point}:step-4"}))
    assert crashed.wait() == 137, crashed.output  # the SIGKILLed worker's status
    assert crashed.leftovers() == []
    assert (ckpt / "latest").read_text() == "step-2\n"
    assert (ckpt / ".tmp-step-4").is_dir() and not (ckpt / "step-4").exists()
    assert checkpoint_format.tags(ckpt) == ["step-2"]
    assert len(checkpoint_tools.consolidate(ckpt)) == 4  # the previous checkpoint loads: two Linear layers
    if point != "shard":
        return
    _resumes_from_step_2_exactly(launch, launch_once, _keys(ckpt, async_save))


@pytest.mark.slow
def test_launcher_killed_during_a_background_write_leaves_latest_no_worker_and_resumes_exactly(launch, launch_once,
                                                                                               tmp_path):
    ckpt = tmp_path / "ckpt"
    job = launch("train_checkpointed.py", **_keys(ckpt, True, **{SLOW_ENV: "1.0"}))  # ~3 s per rank file
    writing = ckpt / ".tmp-step-4" / checkpoint_format.shard_file(1)
    deadline = time.monotonic() + 120
    while not writing.is_file() and job.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writing.is_file(), job.output
    assert (ckpt / "latest").read_text() == "step-2\n"  # step-4 is being written: step-2 was committed first
    job.proc.kill()  # SIGKILL to `zerorun launch` itself, no teardown of its own
    assert job.wait() == -9
    deadline = time.monotonic() + TEARDOWN_LIMIT_S
    while job.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.leftovers() == []
    assert (ckpt / "latest").read_text() == "step-2\n" and not (ckpt / "step-4").exists()
    assert (ckpt / ".tmp-step-4").is_dir() and checkpoint_format.tags(ckpt) == ["step-2"]
    keys = _keys(ckpt, True)
    keys["checkpoint"]["every_steps"] = 3  # no new step-4: only the start (or the save of step-3) removes the old
    _resumes_from_step_2_exactly(launch, launch_once, keys)
    assert checkpoint_format.tags(ckpt) == ["step-2", "step-3", "step-6"]


def _resumes_from_step_2_exactly(launch, launch_once, keys: dict) -> None:
    """A new launch on the crashed directory resumes from step-2, removes the partial `.tmp-step-4`, and
    ends where an uninterrupted run ends (one per module: checkpoints, however taken, change no number)."""
    ckpt = Path(keys["checkpoint"]["dir"])
    resumed = launch("train_checkpointed.py", **keys)
    assert resumed.wait() == 0, resumed.output
    assert "[localhost:0] rank 0 resumed from step-2 at step 2" in resumed.stdout
    assert not (ckpt / ".tmp-step-4").exists() and (ckpt / "latest").read_text() == "step-6\n"
    whole = launch_once("train_checkpointed.py", **_keys("uninterrupted", async_save=False))
    assert whole.wait() == 0, whole.output
    assert _final(resumed) == _final(whole) and len(_final(whole)) == 2, resumed.output + whole.output
