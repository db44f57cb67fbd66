"""`zerorun tune` for real: trials through the launcher on 2 CPU ranks, a recipe written, nothing left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from zerorun import config
from zerorun.cli import app

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "recipes/quickstart.yaml"
BUDGET_MIN = 0.5
# After the deadline the running trial gets SIGTERM and the launcher stops its job (kill_grace_s 3 s,
# then the pipes drain); on a loaded 2-core machine that has taken up to ~8 s.
TEARDOWN_S = 15.0
_JOB = re.compile(r"^zerorun: job (\S+): ", re.M)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _job_ids(tune_dir: Path) -> list[str]:
    return [m.group(1) for log in tune_dir.glob("t*.log") for m in _JOB.finditer(log.read_text(errors="replace"))]


def _running(job_ids: list[str]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["environ"], ad_value=None):
        if (proc.info.get("environ") or {}).get("ZERORUN_JOB_ID") in job_ids and proc.status() != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.mark.slow
def test_tuning_the_quick_start_writes_a_recipe_that_loads_with_what_it_measured(tmp_path: Path) -> None:
    out = tmp_path / "tuned.yaml"
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "tune", str(QUICKSTART), "--budget-min",
                             str(BUDGET_MIN), "--out", str(out), "--json"],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(result.stdout)
    assert report["elapsed_s"] <= report["budget_s"] + TEARDOWN_S, report["notes"]
    measured = [t for t in report["trials"] if t["status"] == "measured"]
    assert measured and all(t["throughput"] > 0 and t["peak_rss"] > 100 * 2**20 for t in measured)
    assert all(t["samples_per_step"] == [t["candidate"]["micro_batch"] * t["candidate"]["grad_accum"]]
               for t in measured)  # the script ran each candidate's batch: the engine counted it
    nvme = [r for r in report["rejected"] if r["candidate"]["offload_optimizer"] == "nvme"]
    assert nvme and all("--nvme-path" in r["reason"] for r in nvme)  # reported, not fatal

    winner, chosen = report["winner"], report["chosen"]
    assert winner["throughput"] == max(t["throughput"] for t in measured)
    assert chosen["index"] == (winner if report["vs_recipe"] is None or report["vs_recipe"]["supported"]
                               else next(t for t in report["trials"] if t["phase"] == "baseline"))["index"]
    tuned = config.load(out)  # valid, and its script (moved relative to the new file) exists
    for key, value in chosen["candidate"].items():
        name = {"offload_optimizer": "zero.offload_optimizer.device", "offload_param": "zero.offload_param.device",
                "micro_batch": "train.micro_batch_size", "grad_accum": "train.grad_accum_steps",
                "checkpointing": "train.activation_checkpointing", "bucket_mb": "zero.bucket_mb",
                "stage": "zero.stage", "host_share": "zero.offload_optimizer_ratio"}[key]
        section, _, field = name.rpartition(".")
        holder = tuned
        for part in section.split("."):
            holder = getattr(holder, part)
        assert getattr(holder, field) == value, name
    text = out.read_text()
    header = [line for line in QUICKSTART.read_text().splitlines() if line.startswith("#")]
    assert all(line in text for line in header if " stage " not in line)  # the stage is restated where it changed
    original = config.load(QUICKSTART)
    assert tuned.optimizer == original.optimizer and tuned.train.steps == original.train.steps
    changed = text.count("# tuned:")
    assert changed >= sum(1 for k, v in chosen["candidate"].items() if report["baseline"][k] != v)
    assert _running(_job_ids(Path(tmp_path, report["tune_dir"]))) == []


def test_a_killed_tuner_leaves_no_trial_running(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "zerorun.cli", "tune", str(QUICKSTART), "--budget-min", "10",
                             "--out", str(tmp_path / "tuned.yaml")],
                            cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        jobs: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            jobs = [job for run in (tmp_path / "runs").glob("*/tune-*") for job in _job_ids(run)]
            if jobs and list((tmp_path / "runs").glob("*/tune-*/t01/telemetry.jsonl")):
                break
        assert jobs, "the first trial never started"
        proc.send_signal(signal.SIGKILL)  # uncatchable: only the trial's own guard can end its job now
        proc.wait()
        deadline = time.monotonic() + 60
        while _running(jobs) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _running(jobs) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_ctrl_c_stops_the_trial_and_still_reports_what_was_measured(tmp_path: Path) -> None:
    out = tmp_path / "tuned.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "zerorun.cli", "tune", str(QUICKSTART), "--budget-min", "10",
                             "--out", str(out), "--json"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # until the second trial has started
            time.sleep(0.5)
            if list((tmp_path / "runs").glob("*/tune-*/t02/telemetry.jsonl")):
                break
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    report = json.loads(stdout)
    assert report["interrupted"] and report["trials"][0]["status"] == "measured"
    assert report["winner"] is not None and config.load(out).zero.stage == report["winner"]["candidate"]["stage"]
    assert _running([job for run in (tmp_path / "runs").glob("*/tune-*") for job in _job_ids(run)]) == []


@pytest.mark.parametrize("flags, message", [
    (["--micro-batches", "3"], "--micro-batches: 3 do not divide the per-rank batch 16"),
    (["--stages", "1,5"], "--stages takes values of 0-3"),
    (["--micro-batches", "x"], "--micro-batches: expected comma-separated ints, got 'x'"),
])
def test_bad_flags_are_refused_before_anything_runs(flags: list[str], message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["tune", str(QUICKSTART), *flags, "--out", str(tmp_path / "t.yaml")])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.slow
def test_a_budget_below_every_candidates_need_is_a_table_of_reasons_not_a_crash(tmp_path: Path) -> None:
    # the standard GPT's 97.7M parameters, counted on the meta device: no candidate fits 0.25 GiB per rank
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "tune", str(ROOT / "recipes/bench_gpt.yaml"),
                             "--model", "zerorun.bench.gpt:GPT", "--cpu-mem", "0.5", "--json",
                             "--out", str(tmp_path / "t.yaml")],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["trials"] == [] and report["winner"] is None and not (tmp_path / "t.yaml").exists()
    reasons = {r["reason"] for r in report["rejected"]}
    assert any(re.fullmatch(r"estimate \d+\.\d\d GiB RSS/rank > budget 0\.25 GiB", r) for r in reasons), reasons


@pytest.mark.slow
def test_the_manual_sweep_measures_every_candidate_of_the_same_space_against_a_reference(
        tmp_path: Path, direct_io_dir: Path) -> None:
    nvme = direct_io_dir / "nvme"
    nvme.mkdir()
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "tune", str(QUICKSTART), "--budget-min", "0.5",
                             "--stages", "2", "--offloads", "none,nvme", "--nvme-path", str(nvme),
                             "--micro-batches", "8", "--bucket-mb", "4", "--sweep", "1", "--json",
                             "--out", str(tmp_path / "t.yaml")],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    sweep = json.loads(result.stdout)["sweep"]
    labels = sorted(row["label"] for row in sweep["rows"])
    assert labels == sorted(f"stage 2, {off}micro 8 x 2, {ckpt}bucket 4" for off in ("", "optimizer->nvme, ")
                            for ckpt in ("", "ckpt, "))
    assert all(row["status"] == "measured" for row in sweep["rows"])
    assert list(nvme.iterdir()) == []  # every NVMe trial's offload files are gone
    reference = next(row for row in sweep["rows"] if row["candidate"] == sweep["reference"])
    assert len(reference["trials"]) == 2 and reference["label"] == "stage 2, micro 8 x 2, bucket 4"  # first, last
    assert all(len(row["corrected"]) == 1 for row in sweep["rows"] if row is not reference)
    assert re.search(r"measures [\d,]+ in the sweep = \d\.\d{3} x the sweep's best", sweep["verdict"])
