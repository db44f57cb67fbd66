"""The `zerorun` command line: errors are one line with status 2, dry runs start nothing, `env` reports."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import zerorun
from tests.launch.launched import subprocess_env, write_recipe
from zerorun.cli import app


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, "allreduce.py", nproc_per_node=2)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_bad_recipe_is_one_line_on_stderr_with_status_2_and_no_traceback(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("script: train.py\nzero:\n  stage: 7\n")
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "launch", str(bad)],
                            capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("zerorun: error: ") and f"{bad}:3" in line and "zero.stage" in line


def test_missing_recipe_file_is_a_one_line_error(tmp_path: Path):
    result = invoke("launch", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert result.stderr.startswith("zerorun: error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_bad_set_override_is_a_one_line_error(recipe: Path):
    result = invoke("launch", str(recipe), "--set", "zero.stage")
    assert result.exit_code == 2 and "--set zero.stage: expected KEY=VALUE" in result.stderr


def test_dry_run_prints_every_nodes_command_and_env_and_starts_nothing(recipe: Path, tmp_path: Path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-1 slots=2\n")  # remote hosts: a real launch would refuse
    result = invoke("launch", str(recipe), "--hostfile", str(hosts), "--set", "zero.stage=3", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "2 nodes, 4 workers, master worker-0:" in result.stdout
    assert "node 1: worker-1  ranks 2-3" in result.stdout
    assert result.stdout.count("-m zerorun.launch.torchrun") == 2
    assert "ZERORUN_JOB_ID=" in result.stdout


def test_an_unreachable_remote_host_fails_preflight_with_a_launch_error_naming_it(recipe: Path, tmp_path: Path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0.invalid slots=2\n")
    result = invoke("launch", str(recipe), "--hostfile", str(hosts))
    assert result.exit_code == 2
    assert result.stderr.startswith("zerorun: error: preflight failed on 1 of 1 host(s); nothing was started.")
    assert "worker-0.invalid" in result.stderr and "unreachable over ssh" in result.stderr


def test_version_prints_the_package_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"zerorun {zerorun.__version__}"


def test_env_json_reports_versions_devices_compilers_and_kernels():
    result = invoke("env", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["zerorun"]["version"] == zerorun.__version__
    assert report["torch"]["version"] and "cuda available" in report["torch"]
    assert report["distributed"]["gloo"] is True
    assert set(report["compilers"]) == {"gcc", "g++", "nvcc", "ninja"}
    assert report["system"]["cpus"] >= 1
    if importlib.util.find_spec("zerorun.ops") is None:
        assert report["kernels"]["status"] == "not built (zerorun.ops unavailable)"


def test_env_prints_a_table():
    result = invoke("env")
    assert result.exit_code == 0, result.output
    assert "environment" in result.stdout and "kernels" in result.stdout and "torch" in result.stdout


@pytest.mark.parametrize(("args", "nearest"), [
    (["launch", "r.yaml", "--nproc", "4"], "--set nproc_per_node=N"),  # torchrun's habit: the recipe key
    (["launch", "r.yaml", "--nproc-per-node", "4"], "--set nproc_per_node=N"),
    (["launch", "r.yaml", "--dryrun"], "--dry-run"),
    (["launch", "r.yaml", "--nnode", "2"], "--nnodes"),  # torchrun's --nnodes is a flag: every node its own launcher
    (["launch", "r.yaml", "--stage", "3"], "--set zero.stage=N"),
    (["estimate", "--gpus", "8"], "--gpus-per-node"),  # a prefix: below difflib's cutoff before
    (["estimate", "--param", "7B"], "--params"),
    (["bench", "step", "--nproc", "3"], "--ranks"),  # another launcher's word for it; --set here: zero.* only
    (["bench", "step", "--prefetch-units", "2"], "--set zero.prefetch_units=auto|N"),
    (["checkpoint", "consolidate", "ckpt", "--fromat", "hf"], "--format"),
    (["--verison"], "--version"),
])
def test_every_unknown_flag_names_the_nearest_real_one(args: list[str], nearest: str):
    result = invoke(*args)
    assert result.exit_code == 2
    message = " ".join(result.output.replace("│", " ").split())  # the usage box wraps long lines
    assert f"No such option: {args[-2] if args[-1][0] != '-' else args[-1]}. The nearest: {nearest}" in message, \
        result.output
    assert "Traceback" not in result.output


def test_a_flag_near_nothing_still_gets_the_least_far_and_a_pointer_to_help():
    from zerorun.cli import suggest

    text = suggest.message("--xyz", ["--dry-run", "--set"], with_recipe_keys=False, command="zerorun launch")
    assert text.startswith("No such option: --xyz. The nearest: --")
    assert text.endswith("though not near; `zerorun launch --help` lists every option.")
