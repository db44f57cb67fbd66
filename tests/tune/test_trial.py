"""One trial through the real launcher: its overrides, a script that fails, a script that hangs."""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

from zerorun import config
from zerorun.tune.measure import Status
from zerorun.tune.space import Candidate
from zerorun.tune.trial import STEPS_CAP, TrialRunner, TrialSetup, trial_overrides

CANDIDATE = Candidate(3, "nvme", "cpu", 4, 2, True, 6.25)


def test_a_trials_overrides_set_the_candidate_and_keep_it_away_from_the_users_runs(tmp_path: Path) -> None:
    setup = TrialSetup(str(tmp_path / "r.yaml"), "gpt", "tune-1", overrides=("optimizer.lr=0.1",),
                       nvme_path="/local/nvme", warmup=2)
    sets = trial_overrides(setup, CANDIDATE, 7)
    assert sets[0] == "optimizer.lr=0.1"  # the user's first: the candidate's keys win over them
    recipe = config.loads("script: t.py\ncheckpoint: {dir: ckpt, resume: auto}\n", overrides=sets)
    zero = recipe.zero
    assert (zero.stage, zero.offload_optimizer.device, zero.offload_param.device) == (3, "nvme", "cpu")
    assert recipe.zero.offload_optimizer.nvme_path == "/local/nvme" and recipe.zero.offload_param.nvme_path is None
    assert (recipe.train.micro_batch_size, recipe.train.grad_accum_steps) == (4, 2)
    assert recipe.train.activation_checkpointing and recipe.zero.bucket_mb == 6.25
    assert recipe.name == "gpt/tune-1/t07" and recipe.train.steps == 2 + STEPS_CAP
    assert recipe.checkpoint.dir == str(Path("runs/gpt/tune-1/t07-ckpt")) and recipe.checkpoint.resume == "never"
    assert recipe.telemetry.enabled


def _recipe(tmp_path: Path, body: str) -> Path:
    (tmp_path / "script.py").write_text(body)
    path = tmp_path / "recipe.yaml"
    path.write_text("script: script.py\nnproc_per_node: 2\nlaunch: {kill_grace_s: 1}\n")
    return path


def _runner(recipe: Path) -> TrialRunner:
    return TrialRunner(TrialSetup(str(recipe), "r", "tune-test", warmup=1, steps=2, min_seconds=0.0))


def _job_processes(log: str) -> list[psutil.Process]:
    job = re.search(r"^zerorun: job (\S+): ", Path(log).read_text(), re.M)
    assert job, Path(log).read_text()
    return [p for p in psutil.process_iter(["environ"], ad_value=None)
            if (p.info.get("environ") or {}).get("ZERORUN_JOB_ID") == job.group(1) and p.status() != "zombie"]


@pytest.mark.slow
def test_a_failing_script_is_a_result_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path, "raise ValueError('the data directory is empty')\n")
    trial = _runner(recipe).run(Candidate(2, "none", "none", 2, 1, False, 25.0), 1, "baseline",
                                lambda records: None)
    assert trial.status is Status.FAILED and trial.cause == "ValueError: the data directory is empty"
    assert Path(trial.log).is_file() and trial.throughput is None


@pytest.mark.slow  # a real launch
def test_a_trial_without_steps_is_stopped_and_leaves_nothing_running(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path, "import time\nprint('loading', flush=True)\ntime.sleep(600)\n")
    trial = _runner(recipe).run(Candidate(2, "none", "none", 2, 1, False, 25.0), 1, "baseline",
                                lambda records: None, stall_s=5.0)
    assert trial.status is Status.STALLED and re.fullmatch(r"no step for \d+ s", trial.cause), trial.cause
    assert trial.wall_s < 120
    assert _job_processes(trial.log) == []
