"""A launch whose workers exceed this CPU host's cores, or cannot fit its memory, is refused before it starts.

`nproc_per_node: 64` on a 2-core machine used to start 64 workers (17.4 GiB of RSS, 99.6 s for 5 steps)
and exit 0 without a word.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.launched import subprocess_env, write_recipe
from zerorun.errors import LaunchError
from zerorun.launch import capacity
from zerorun.launch.devices import gpu_count
from zerorun.launch.hostfile import Node
from zerorun.launch.plan import MachineFacts, plan

GIB = 2**30


def _nodes(*nodes: Node):
    from zerorun import config

    return plan(config.from_dict({"script": "/x/t.py"}), list(nodes), "j", 1, MachineFacts(2, "py")).nodes


def test_more_workers_than_cores_on_a_cpu_host_is_refused_naming_cores_key_and_the_way_out() -> None:
    two_cores = capacity.Machine(cores=2, gpus=0, available_bytes=24 * GIB)
    with pytest.raises(LaunchError) as info:
        capacity.check(_nodes(Node("localhost", tuple(range(64)))), two_cores, False, "r.yaml:3: nproc_per_node: 64")
    message = str(info.value)
    assert message.startswith("r.yaml:3: nproc_per_node: 64 starts 64 workers on this machine, which has 2 CPU cores")
    assert "launch.oversubscribe: true" in message and "Ask for at most 2" in message
    capacity.check(_nodes(Node("localhost", tuple(range(64)))), two_cores, True, "meant")  # oversubscribe: allowed
    capacity.check(_nodes(Node("localhost", (0, 1))), two_cores, False, "as many as cores")
    gpu_host = capacity.Machine(cores=2, gpus=8, available_bytes=24 * GIB)  # workers drive GPUs: not checked
    capacity.check(_nodes(Node("localhost", tuple(range(8)))), gpu_host, False, "eight GPUs")
    # another host's cores are its own business: only this machine's workers count
    capacity.check(_nodes(Node("localhost", (0, 1)), Node("worker-1", tuple(range(64)))), two_cores, False, "two hosts")


def test_workers_whose_floor_cannot_fit_the_available_memory_are_refused_even_when_oversubscribed() -> None:
    small = capacity.Machine(cores=512, gpus=0, available_bytes=4 * GIB)
    floor = 64 * capacity.WORKER_FLOOR_BYTES + capacity.NODE_FLOOR_BYTES
    assert floor > 4 * GIB
    with pytest.raises(LaunchError, match=r"need at least 8\.1 GiB .* and 4\.0 GiB is available: nothing was started"):
        capacity.check(_nodes(Node("localhost", tuple(range(64)))), small, True, "--num-gpus 64")
    capacity.check(_nodes(Node("localhost", tuple(range(16)))), small, False, "fits")


@pytest.mark.slow  # starts an interpreter that imports torch
def test_the_worker_floor_is_below_what_a_fresh_interpreter_with_torch_holds_of_its_own() -> None:
    probe = ("import psutil, torch, zerorun.runtime.engine; print(psutil.Process().memory_full_info().uss)")
    uss = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                             env=subprocess_env(), timeout=120).stdout)
    assert uss >= capacity.WORKER_FLOOR_BYTES, f"a worker holds {uss / 2**20:.0f} MiB: lower the floor"


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU machine's workers are not held to its cores")
def test_zerorun_launch_refuses_one_worker_more_than_the_cores_in_one_line_and_starts_nothing(tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0))
    recipe = write_recipe(tmp_path, "allreduce.py", nproc_per_node=cores + 1)
    run = [sys.executable, "-m", "zerorun.cli", "launch", str(recipe)]
    result = subprocess.run(run, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"zerorun: error: {recipe}:") and f"nproc_per_node: {cores + 1} starts {cores + 1} " \
        f"workers on this machine, which has {cores} CPU core" in line
    assert not (tmp_path / "runs").exists()  # nothing was started, no run directory claimed
    meant = subprocess.run([*run, "--set", "launch.oversubscribe=true", "--dry-run"], capture_output=True, text=True,
                           env=subprocess_env(), cwd=tmp_path, timeout=60)
    assert meant.returncode == 0 and f"{cores + 1} workers" in meant.stdout, meant.stderr
