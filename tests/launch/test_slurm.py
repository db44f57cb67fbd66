"""Slurm: the allocation's parsing and the srun/sbatch commands (pure), then real jobs on a private
one-node cluster (munged + slurmctld + slurmd from a temp dir, see `slurm_cluster`).

The cluster tests show that `salloc -N1 -n2 zerorun launch` trains exactly like a local launch with
telemetry from the node, that Ctrl-C or a killed launcher ends the step with nothing left, and that
`zerorun submit` runs a job to completion (or to its failing rank's exit code) while following its
output and telemetry. "Nothing left" means no live process carrying the job's ZERORUN_JOB_ID; the
cluster's own daemons and every slurmstepd are checked when it is torn down.
"""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from tests.launch.launched import BIG_RECIPE_ENV, SCRIPTS, LaunchedJob, recipe_files_shown, subprocess_env, write_recipe
from tests.launch.slurm_cluster import PrivateSlurm, missing_programs
from zerorun import config
from zerorun.cli import app
from zerorun.errors import LaunchError
from zerorun.launch import slurm, submit
from zerorun.launch.launcher import LaunchOptions, transport_for, uses_slurm
from zerorun.launch.plan import MachineFacts, render

TEARDOWN_LIMIT_S = 15.0
TELEMETRY_SCRIPT = SCRIPTS.parent.parent / "telemetry" / "scripts" / "tiny_train.py"

# ---------------------------------------------------------------------------------------------
# Pure: the allocation, the step, the batch script


def test_nodelists_expand_ranges_keep_zero_padding_and_plain_names():
    assert slurm.expand_nodelist("gpu[01-03,07],cpu1") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu1"]
    assert slurm.expand_nodelist("node[8-10]") == ["node8", "node9", "node10"]
    assert slurm.expand_nodelist("a,b-2,localhost") == ["a", "b-2", "localhost"]
    assert slurm.expand_nodelist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    with pytest.raises(LaunchError, match="cannot read the Slurm nodelist 'gpu\\[01-'"):
        slurm.expand_nodelist("gpu[01-")


def test_per_node_counts_expand_repeats_and_must_cover_every_node():
    assert slurm.expand_counts("2(x3),1", 4, "SLURM_TASKS_PER_NODE") == [2, 2, 2, 1]
    assert slurm.expand_counts("8", 1, "SLURM_TASKS_PER_NODE") == [8]
    with pytest.raises(LaunchError, match=r"SLURM_TASKS_PER_NODE=2\(x2\) gives 2 node\(s\), the allocation has 3"):
        slurm.expand_counts("2(x2)", 3, "SLURM_TASKS_PER_NODE")
    with pytest.raises(LaunchError, match="expected counts like 2"):
        slurm.expand_counts("two", 1, "SLURM_TASKS_PER_NODE")


def test_gpus_per_node_come_from_whichever_variable_slurm_set():
    assert slurm.gpus_per_node({"SLURM_GPUS_PER_NODE": "a100:4", "SLURM_GPUS_ON_NODE": "8"}) == 4
    assert slurm.gpus_per_node({"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert slurm.gpus_per_node({"SLURM_JOB_GPUS": "0,1,2"}) == 3
    assert slurm.gpus_per_node({}) == 0


ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "1(x2)",
       "SLURM_JOB_CPUS_PER_NODE": "16(x2)", "SLURM_GPUS_ON_NODE": "4"}


def _allocation(**env: str) -> slurm.Allocation:
    return slurm.read_allocation({**ENV, **env}, hostnames=slurm.expand_nodelist)


def test_allocation_is_read_from_the_slurm_variables():
    assert _allocation() == slurm.Allocation("4242", "gpu[01-02]", ("gpu01", "gpu02"), (1, 1), 4, (16, 16))
    assert _allocation(SLURM_NTASKS_PER_NODE="3").tasks_per_node == (3, 3)
    with pytest.raises(LaunchError, match="not inside a Slurm allocation"):
        slurm.read_allocation({})
    with pytest.raises(LaunchError, match="runs here as task 3 of an srun step of 4 tasks; start it once per job"):
        _allocation(SLURM_STEP_NUM_TASKS="4", SLURM_PROCID="3")


def test_workers_per_node_are_the_recipes_else_the_gpus_else_the_tasks_which_must_be_even():
    assert slurm.procs_per_node(_allocation(), requested=2) == 2
    assert slurm.procs_per_node(_allocation(), requested=None) == 4
    no_gpus = dict(SLURM_GPUS_ON_NODE="0", SLURM_JOB_NODELIST="n[1-4]", SLURM_JOB_CPUS_PER_NODE="16(x4)")
    assert slurm.procs_per_node(_allocation(**no_gpus, SLURM_TASKS_PER_NODE="2(x4)"), None) == 2
    uneven = _allocation(**no_gpus, SLURM_TASKS_PER_NODE="2(x3),1")
    with pytest.raises(LaunchError, match=r"uneven tasks per node \(1, 2\).*set nproc_per_node in the recipe"):
        slurm.procs_per_node(uneven, None)


def test_the_step_is_one_srun_whose_torchrun_takes_its_node_rank_from_slurm():
    recipe = config.from_dict({"script": "/jobs/train.py", "args": ["--lr", "1"], "env": {"A": "1"}})
    facts = MachineFacts(cpu_count=16, python="/venv/bin/python", inherited_env={}, cwd="/jobs")
    launch_plan = slurm.plan_step(recipe, _allocation(), 4, "job-1", 29500, facts)
    (step,) = launch_plan.nodes
    assert (launch_plan.world_size, launch_plan.master_addr, step.step_nodes) == (8, "gpu01", ("gpu01", "gpu02"))
    argv = list(step.argv)
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        "--job-name=job-1"]
    assert argv[6:16] == ["/venv/bin/python", "-m", "zerorun.launch.slurm", "--kill-grace-s", "3", "--run-name",
                          "job", "--ranks-per-node", "4", "--"]
    torchrun = argv[16:]
    for flag, value in [("--nnodes", "2"), ("--node-rank", "$SLURM_NODEID"), ("--nproc-per-node", "4"),
                        ("--master-addr", "gpu01"), ("--master-port", "29500")]:
        assert torchrun[torchrun.index(flag) + 1] == value
    assert torchrun[-3:] == ["/jobs/train.py", "--lr", "1"]
    assert "CUDA_VISIBLE_DEVICES" not in step.env and "ZERORUN_NODE_HOST" not in step.env  # set on each node
    assert (step.env["OMP_NUM_THREADS"], step.env["A"], step.env["ZERORUN_JOB_ID"]) == ("4", "1", "job-1")
    assert type(transport_for(step, launch_plan)).__name__ == "SlurmTransport"
    text = render(launch_plan)
    assert "2 nodes, 8 workers, master gpu01:29500" in text
    assert "srun step on gpu[01-02] (gpu01, gpu02): 4 workers per node, ranks 0-7" in text
    assert "    srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --job-name=job-1 " in text
    assert "--node-rank '$SLURM_NODEID'" in text


def test_srun_carries_the_recipe_in_parts_under_128_kib_that_the_node_entry_joins_and_takes_away():
    recipe = json.dumps({"env": {f"K{i}": "v" * 1000 for i in range(300)}})  # 300 KiB
    env = slurm.recipe_in_parts({"ZERORUN_RECIPE": recipe, "ZERORUN_RECIPE_PART_9": "stale", "A": "1"})
    parts = sorted(key for key in env if key.startswith("ZERORUN_RECIPE"))
    assert parts == [f"ZERORUN_RECIPE_PART_{i}" for i in range(5)] and env["A"] == "1"
    assert max(len(key) + len(env[key]) for key in parts) < 128 << 10
    assert slurm.take_recipe(env) == recipe and env == {"A": "1"}
    assert slurm.take_recipe({"A": "1"}) is None
    with pytest.raises(LaunchError, match="ZERORUN_RECIPE_PART_0, ZERORUN_RECIPE_PART_2: not one run"):
        slurm.take_recipe({"ZERORUN_RECIPE_PART_0": "{", "ZERORUN_RECIPE_PART_2": "}"})


def test_slurm_is_used_inside_an_allocation_unless_a_hostfile_or_the_launcher_says_otherwise(tmp_path):
    def decide(transport: str, env: dict[str, str], launcher: str | None = None, **keys: object) -> bool:
        recipe = config.loads(json.dumps({"script": "t.py", "launch": {"transport": transport}, **keys}), "r.yaml")
        return uses_slurm(recipe, LaunchOptions(launcher=launcher), env)

    assert decide("auto", ENV) and not decide("auto", {}) and not decide("auto", ENV, hostfile="hosts")
    assert not decide("local", ENV) and not decide("ssh", ENV) and decide("slurm", ENV)
    with pytest.raises(LaunchError, match=r"^--launcher slurm: not inside a Slurm allocation \(SLURM_JOB_ID"):
        decide("slurm", {}, launcher="slurm")
    with pytest.raises(LaunchError, match=r"^r.yaml: launch.transport: slurm: the nodes are the Slurm allocation's"):
        decide("slurm", ENV, hostfile="hosts")


def test_the_batch_script_is_readable_bash_with_the_directives_and_the_launch(tmp_path):
    recipe = config.from_dict({"script": "t.py", "name": "gpt"})
    options = submit.SubmitOptions(nodes=2, gpus_per_node=8, partition="gpu", time="4:00:00", account="proj",
                                   sbatch_args=("--mem=0",), overrides=("zero.stage=3",))
    text = submit.sbatch_script(recipe, Path("/jobs/gpt.yaml"), options, "/venv/bin/python", Path("/jobs"),
                                Path("/jobs/runs/gpt/slurm-%j.out"), "2025-01-02 03:04:05")
    directives = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["--job-name=gpt", "--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8",
                          "--partition=gpu", "--time=4:00:00", "--account=proj",
                          "--output=/jobs/runs/gpt/slurm-%j.out", "--mem=0"]
    assert text.splitlines()[-1] == ("exec /venv/bin/python -m zerorun.cli launch /jobs/gpt.yaml --launcher slurm "
                                     "--set zero.stage=3")
    assert "cd /jobs\n" in text and text.startswith("#!/bin/bash\n# Written by `zerorun submit` on 2025-01-02")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_a_jobs_exit_status_is_its_code_or_128_plus_its_signal():
    assert submit.exit_status("0:0", "COMPLETED") == 0
    assert submit.exit_status("3:0", "FAILED") == 3
    assert submit.exit_status("0:15", "CANCELLED") == 143
    assert submit.exit_status("0:0", "CANCELLED") == 1  # cancelled before it ran
    state = submit.parse_job("JobId=7 JobName=x JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 Nodes=1")
    assert state == submit.JobState("FAILED", "NonZeroExitCode", "3:0") and state.ended and state.exit_status == 3


def test_submit_without_sbatch_is_a_one_line_error(tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path, "allreduce.py")
    monkeypatch.setenv("PATH", str(tmp_path))
    result = CliRunner().invoke(app, ["submit", str(recipe), "--nodes", "2"])
    assert result.exit_code == 2
    assert result.stderr == ("zerorun: error: sbatch is not on PATH: `zerorun submit` needs Slurm's client "
                             "commands (run it on a login node of the cluster).\n")


# ---------------------------------------------------------------------------------------------
# A real one-node cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """The private cluster; skips when Slurm or munge is not installed (CI installs slurm-wlm and munge)."""
    missing = missing_programs()
    if missing:
        pytest.skip(f"Slurm is not installed (no {', '.join(missing)}; apt-get install slurm-wlm munge)")
    server = PrivateSlurm.start(tmp_path_factory.mktemp("slurm"), cpus=2)
    yield server
    server.stop()
    left = server.leftovers()
    assert left == [], f"the private cluster left processes behind: {left}"


@pytest.mark.slow
def test_our_nodelist_reading_agrees_with_scontrol(cluster):
    for nodelist in ("gpu[01-03,07],cpu1", "node[8-10]", "a,b-2,localhost", "r[1-2]-n[01-02]"):
        assert cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split() == slurm.expand_nodelist(nodelist)


def _salloc(cluster: PrivateSlurm, recipe: Path, *flags: str) -> LaunchedJob:
    """`salloc -N1 -n2 zerorun launch RECIPE FLAGS` from the recipe's directory."""
    argv = ["salloc", "-N1", "-n2", sys.executable, "-m", "zerorun.cli", "launch", str(recipe), *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cluster.env(subprocess_env()), cwd=recipe.parent)
    return LaunchedJob(proc)


def _launcher_of(job: LaunchedJob) -> psutil.Process:
    """The `zerorun launch` process that salloc started."""
    (launcher,) = [p for p in psutil.Process(job.proc.pid).children() if "zerorun.cli" in " ".join(p.cmdline())]
    return launcher


def _no_leftovers_within(job: LaunchedJob, seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (left := job.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _final_losses(lines: list[str]) -> dict[int, str]:
    """rank -> "final loss ... checksum ..." from the train_tiny.py lines (the prefix dropped)."""
    found = {}
    for line in lines:
        if "final loss" in line:
            text = line.split("] ", 1)[1]
            found[int(text.split()[1])] = text
    return found


@pytest.mark.slow
def test_training_under_salloc_matches_the_local_run_and_its_telemetry_reaches_the_launcher(cluster, launch,
                                                                                           tmp_path):
    keys = {"train": {"steps": 4}, "zero": {"stage": 2}}
    under_salloc = _salloc(cluster, write_recipe(tmp_path, "train_tiny.py", **keys))
    assert under_salloc.wait() == 0, under_salloc.output
    assert re.search(r"^zerorun: job \S+: 1 node, 2 workers", "\n".join(under_salloc.stderr), re.M)
    summary = [line.split()[:2] for line in under_salloc.stderr if line.startswith("localhost ")]
    assert ["localhost", "0"] in summary and ["localhost", "1"] in summary, under_salloc.output
    local = launch("train_tiny.py", **keys)
    assert local.wait() == 0, local.output
    assert sorted(_final_losses(under_salloc.stdout)) == [0, 1]
    assert _final_losses(under_salloc.stdout) == _final_losses(local.stdout)
    assert under_salloc.leftovers() == [] and local.leftovers() == []


@pytest.mark.slow
def test_dry_run_inside_an_allocation_prints_the_srun_command_and_its_environment(cluster, tmp_path):
    job = _salloc(cluster, write_recipe(tmp_path, "allreduce.py"), "--dry-run")
    assert job.wait() == 0, job.output
    text = "\n".join(job.stdout)
    assert "srun step on localhost: 2 workers per node, ranks 0-1" in text
    assert re.search(r"^    srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --kill-on-bad-exit=1 .*"
                     r"-m zerorun.launch.slurm --kill-grace-s 1 --run-name recipe --ranks-per-node 2 -- "
                     r".*--node-rank '\$SLURM_NODEID'", text, re.M)
    assert "    ZERORUN_JOB_ID=" in text and "rank 0 of 2" not in text


@pytest.mark.slow
def test_a_recipe_over_128_kib_launches_through_srun(cluster, tmp_path):
    job = _salloc(cluster, write_recipe(tmp_path, "show_recipe.py", env=BIG_RECIPE_ENV))
    assert job.wait() == 0, job.output
    path = recipe_files_shown(job, ranks=2)
    assert job.job_id in path and not Path(path).exists()  # each node's own copy, removed at the end
    assert job.leftovers() == []


@pytest.mark.slow
def test_ctrl_c_on_the_launcher_cancels_the_step_and_stops_stubborn_workers(cluster, tmp_path):
    job = _salloc(cluster, write_recipe(tmp_path, "stubborn.py", telemetry={"enabled": False}))
    job.wait_for("ready", count=2)
    assert len(job.worker_pids()) == 6  # two workers, a child and a daemon of each
    _launcher_of(job).send_signal(signal.SIGINT)
    started = time.monotonic()
    assert job.wait() == 130, job.output
    assert time.monotonic() - started < TEARDOWN_LIMIT_S
    assert "received SIGINT; stopping job" in "\n".join(job.stderr)
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_launcher_killed_with_sigkill_leaves_nothing_of_the_step(cluster, tmp_path):
    job = _salloc(cluster, write_recipe(tmp_path, "stubborn.py", telemetry={"enabled": False}))
    job.wait_for("ready", count=2)
    _launcher_of(job).kill()  # srun gets SIGUSR2 (its parent-death signal) and forwards it to the step
    job.wait()
    assert _no_leftovers_within(job, TEARDOWN_LIMIT_S) == []


def _submit(cluster: PrivateSlurm, recipe: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zerorun.cli", "submit", str(recipe), "--nodes", "1"],
                          capture_output=True, text=True, env=cluster.env(subprocess_env()), cwd=recipe.parent,
                          timeout=120)


@pytest.mark.slow
def test_ctrl_c_while_following_asks_and_scancels_the_job(cluster, tmp_path):
    recipe = write_recipe(tmp_path, "stubborn.py", telemetry={"enabled": False})
    proc = subprocess.Popen([sys.executable, "-m", "zerorun.cli", "submit", str(recipe)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cluster.env(subprocess_env()), cwd=tmp_path)
    job = LaunchedJob(proc)
    job.wait_for("ready", count=2)
    proc.send_signal(signal.SIGINT)
    proc.stdin.write("y\n")  # the answer waits in the pipe for the question
    proc.stdin.close()
    assert job.wait() == 143, job.output  # the batch script's launcher got SIGTERM from scancel
    slurm_id = re.search(r"submitted Slurm job (\d+)", "\n".join(job.stderr)).group(1)
    assert job.stderr[-1] == f"Cancel Slurm job {slurm_id} (scancel)? [y/N]:", job.output
    assert cluster.job_state(slurm_id) == "CANCELLED"
    assert f"zerorun: cancelled job {slurm_id}; following it to its end" in "\n".join(job.stdout)
    assert _zerorun_job_leftovers("\n".join(job.stdout)) == []


def _zerorun_job_leftovers(stdout: str) -> list[psutil.Process]:
    """Live processes of the zerorun job that the followed output announced."""
    job_id = re.search(r"^zerorun: job (\S+): ", stdout, re.M).group(1)
    return [p for p in psutil.process_iter(["environ"], ad_value=None)
            if (p.info.get("environ") or {}).get("ZERORUN_JOB_ID") == job_id]


@pytest.mark.slow
def test_submit_runs_the_job_to_completion_following_its_output_and_telemetry(cluster, tmp_path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"script: {TELEMETRY_SCRIPT}\ntrain: {{steps: 3}}\nlaunch: {{kill_grace_s: 1}}\n")
    result = _submit(cluster, recipe)
    assert result.returncode == 0, result.stdout + result.stderr
    slurm_id = re.search(r"submitted Slurm job (\d+); script (\S+); output (\S+)", result.stderr)
    assert slurm_id, result.stderr
    job_id, script, output = slurm_id.groups()
    assert Path(script).parent == tmp_path / "runs" / "tiny" and "#SBATCH --nodes=1" in Path(script).read_text()
    assert Path(output) == tmp_path / "runs" / "tiny" / f"slurm-{job_id}.out"
    followed = result.stdout
    assert "[localhost:0] memory {" in followed and "[localhost:1] memory {" in followed  # the job's output
    assert re.search(r"^localhost +1 +3 ", followed, re.M), followed  # its telemetry summary, rank 1: 3 steps
    assert followed.rstrip().endswith(f"zerorun: Slurm job {job_id} COMPLETED; exit code 0")
    assert cluster.job_state(job_id) == "COMPLETED"
    assert _zerorun_job_leftovers(followed) == []
    # On a terminal, the follower draws the job's telemetry as a live table from telemetry.jsonl.
    screen = io.StringIO()
    follower = submit._Follower(submit.SubmittedJob(job_id, Path(script), Path(output),
                                                    tmp_path / "runs" / "tiny" / "telemetry.jsonl"), screen, True)
    follower.copy_output()
    follower.refresh()
    follower.close()
    assert re.search(r"localhost +1 +3 ", screen.getvalue()), screen.getvalue()


@pytest.mark.slow
def test_submit_of_a_failing_rank_ends_the_job_with_its_exit_code_and_error(cluster, tmp_path):
    recipe = write_recipe(tmp_path, "stubborn.py", args=["--fail-rank", "1", "--code", "3"],
                          telemetry={"enabled": False})
    result = _submit(cluster, recipe)
    assert result.returncode == 3, result.stdout + result.stderr
    followed = result.stdout
    block = followed[followed.index("rank 1 on localhost failed (exit code 3)"):]
    assert "[localhost:1] rank 1 line 24" in block
    assert re.search(r"zerorun: Slurm job (\d+) FAILED; exit code 3$", followed.rstrip())
    assert _zerorun_job_leftovers(followed) == []


def test_a_node_entry_checks_its_nvme_paths_before_torchrun_starts(tmp_path, capsys):
    shape = slurm.StepShape("run", 2, {"zero.offload_optimizer.nvme_path": str(tmp_path / "absent")})
    env = {"ZERORUN_JOB_ID": "job-1", "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu02"}
    marker = tmp_path / "started"
    code = slurm.run_on_node([sys.executable, "-c", f"open({str(marker)!r}, 'w')"], 1.0, env, shape)
    assert code == 2 and not marker.exists()
    assert f"host gpu02: zero.offload_optimizer.nvme_path: {tmp_path / 'absent'} does not exist" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_a_killed_rank_restarts_as_a_new_step_in_the_same_allocation(cluster, tmp_path):
    recipe = write_recipe(tmp_path, "train_restartable.py",
                          ["--fail-rank", "1", "--fail-at", "3", "--once", str(tmp_path / "once")],
                          train={"steps": 6, "micro_batch_size": 4}, nproc_per_node=2,
                          checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 2},
                          launch={"kill_grace_s": 1.0, "max_restarts": 1}, telemetry={"interval_s": 0.2})
    job = _salloc(cluster, recipe)
    assert job.wait(timeout=300) == 0, job.output
    stderr = "\n".join(job.stderr)
    assert "zerorun: restart 1 of 1 on the same nodes" in stderr
    assert len(job.job_ids) == 2  # a second srun step, under the attempt's own job id
    assert any(line.endswith("rank 1 resumed from step-2 at step 2") for line in job.stdout), job.output
    assert any(line.endswith("rank 0 step 5 loss") or "rank 0 step 5 loss" in line for line in job.stdout)
    assert _no_leftovers_within(job, 15.0) == []


def test_a_shrunk_step_runs_on_the_nodes_that_remain():
    from zerorun.launch.hostfile import Node
    from zerorun.launch.launcher import replan
    from zerorun.launch.recovery import Batch

    recipe = config.from_dict({"script": "/jobs/train.py", "train": {"micro_batch_size": 4}})
    facts = MachineFacts(cpu_count=16, python="/venv/bin/python", inherited_env={}, cwd="/jobs")
    launch_plan = slurm.plan_step(recipe, _allocation(), 4, "job-1", 29500, facts)
    shrunk = replan(launch_plan, [Node("gpu01", (0, 1, 2, 3))], Batch(4, 2), "job-1-r1")
    (step,) = shrunk.nodes
    assert step.argv[:6] == ("srun", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=gpu01",
                             "--kill-on-bad-exit=1")
    assert (shrunk.world_size, step.step_nodes, shrunk.job_id) == (4, ("gpu01",), "job-1-r1")
    assert config.from_dict(json.loads(step.env["ZERORUN_RECIPE"])).train.grad_accum_steps == 2
