"""Kubernetes pods without Kubernetes: every emulated node plays a pod of the generated Indexed Job.

Each node (its own network namespace, host name and /dev/shm; no sshd anywhere, no ssh on the PATH) runs
exactly the container command of the manifest `zerorun submit --to kubernetes` writes, with the
environment the manifest sets, the index the Job controller would add (JOB_COMPLETION_INDEX) and the
Secret's value; the headless Service's pod names resolve as the cluster's DNS would. Node 0's launcher is
the job's console. A pod the test kills and starts again is a pod the cluster replaced.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.launched import LaunchedJob, subprocess_env, write_recipe
from zerorun.bench.cluster import IFACE, EmulatedCluster, unavailable_reason
from zerorun.launch import k8s_submit, kubernetes
from zerorun.launch.secret import SECRET_ENV

pytestmark = pytest.mark.slow  # emulated nodes, real 2-node trainings

SCRIPT = "../../cluster/scripts/pods.py"  # relative to tests/launch/scripts, as write_recipe takes it
SECRET = "k" * 64


@pytest.fixture(scope="module")
def nodes():
    """Two emulated nodes joined by a 1 Gbit/s link, and nothing else: no sshd."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with EmulatedCluster.start(2, "1gbit") as cluster:
        yield cluster


class Pods:
    """The manifest's pods for a recipe, each started on its emulated node as the kubelet would start it."""

    def __init__(self, cluster: EmulatedCluster, directory: Path, args: list[str], **keys: object) -> None:
        self.cluster = cluster
        self.directory = directory
        write_recipe(directory, SCRIPT, args, nproc_per_node=1, **keys)
        pods = k8s_submit.plan_pods(directory / "recipe.yaml", k8s_submit.KubeOptions(nodes=2, image="test"),
                                    directory)
        service, job = kubernetes.manifests(pods)
        self.container = job["spec"]["template"]["spec"]["containers"][0]
        with open(cluster.directory / "hosts", "a") as hosts:  # the headless Service's names, as DNS gives them
            hosts.writelines(f"{node.address} {pods.name}-{node.index}.{service['metadata']['name']}\n"
                             for node in cluster.nodes)
        self.bin = directory / "bin"  # the image's PATH: python, and no ssh
        self.bin.mkdir()
        (self.bin / "python").symlink_to(sys.executable)
        assert shutil.which("ssh", path=str(self.bin)) is None and shutil.which("sshd", path=str(self.bin)) is None
        self.started: list[LaunchedJob] = []

    def env(self, index: int) -> dict[str, str]:
        env = {k: v for k, v in subprocess_env().items() if not k.startswith(("PET_", "MASTER_", "ZERORUN_"))}
        for item in self.container["env"]:
            assert "value" in item or item["name"] == SECRET_ENV  # the one variable from a Secret
            env[item["name"]] = item["value"] if "value" in item else SECRET  # the secretKeyRef, resolved
        return {**env, "PATH": str(self.bin), "JOB_COMPLETION_INDEX": str(index)}

    def start(self, index: int) -> LaunchedJob:
        nsenter, *enter = self.cluster.exec_argv(self.cluster.nodes[index])  # found on this machine's PATH
        workdir = f"--wd={self.directory}"  # the image's working directory, where the recipe is
        proc = subprocess.Popen([shutil.which(nsenter) or nsenter, workdir, *enter, *self.container["command"]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env(index),
                                cwd=self.directory)
        pod = LaunchedJob(proc)
        self.started.append(pod)
        return pod

    def cleanup(self) -> None:
        for pod in self.started:
            pod.cleanup()


@pytest.fixture
def pods(nodes, tmp_path):
    made: list[Pods] = []

    def make(args: list[str], **keys: object) -> Pods:
        made.append(Pods(nodes, tmp_path, args, **keys))
        return made[-1]

    yield make
    for each in made:
        each.cleanup()


def test_pods_train_across_the_link_in_parity_with_ddp_and_node_0_is_the_console(pods):
    job = pods([], train={"steps": 4, "micro_batch_size": 4}, telemetry={"interval_s": 0.2})
    assert job.container["command"][:5] == ["python", "-m", "zerorun.cli", "launch", "recipe.yaml"]
    node0, node1 = job.start(0), job.start(1)
    assert node1.wait(timeout=240) == 0, node1.output
    assert node0.wait(timeout=60) == 0, node0.output
    parity = {int(m.group(1)): float(m.group(2)) for m in
              (re.search(r"\] rank (\d) parity (\S+)$", line) for line in node0.stdout) if m}
    assert set(parity) == {0, 1} and max(parity.values()) < 1e-6, node0.output
    assert any(line.startswith("[node1:1] rank 1 host node1 step 3 loss") for line in node0.stdout), node0.output
    assert any(line.startswith("[node1:1] rank 1 parity") for line in node1.stdout)  # a pod's own log: its node
    assert "zerorun: every node joined: node1" in node0.stderr, node0.output
    assert any(re.search(r"^node1 +1 +4 ", line) for line in node0.stderr), node0.output  # its telemetry, on node 0
    assert node0.leftovers() == [] and node1.leftovers() == []


def test_a_failing_worker_ends_every_pod_within_15_s_and_node_0_names_it_first_with_its_traceback(pods):
    job = pods(["--fail-rank", "1", "--fail-at", "2"], train={"steps": 6, "micro_batch_size": 4})
    node0, node1 = job.start(0), job.start(1)
    assert node1.wait(timeout=240) == 1, node1.output
    assert node0.wait(timeout=60) == 1, node0.output
    failed = node1.time_of("[node1:1] rank 1 fails on purpose before step 2")  # in the failing pod's own log
    teardown = {"node 0": node0.time_of("exit") - failed, "node 1": node1.time_of("exit") - failed}
    print(f"seconds from the failure to each pod's exit: {teardown}")
    assert max(teardown.values()) < 15, (teardown, node0.output)
    report = node0.stderr.index(next(line for line in node0.stderr if "rank 1 on node1 failed" in line))
    assert node0.stderr[report].startswith("===="), node0.output  # the report opens with the culprit
    culprit = node0.stderr[report + 1:report + 40]
    assert culprit[:2] == ["the traceback of rank 1:", "[node1:1] Traceback (most recent call last):"], node0.output
    assert "[node1:1] RuntimeError: rank 1 fails on purpose" in culprit, node0.output
    assert any(re.fullmatch(r"zerorun: job \S+ stopped: rank 1 on node1 failed \(exit code 1\); exit code 1", line)
               for line in node0.stderr), node0.output
    assert node0.leftovers() == [] and node1.leftovers() == []


def _link(node, state: str) -> None:
    subprocess.run(["ip", "-n", node.namespace, "link", "set", IFACE, state], check=True)


@pytest.mark.parametrize("vanish", ["killed", "cut off"])
def test_a_vanished_pod_is_noticed_it_rejoins_and_the_job_resumes(nodes, pods, tmp_path, vanish):
    """Killed: the pod's launcher SIGKILLed, and the cluster replaces the pod. Cut off: its link goes down, no FIN,
    no reset; both sides notice the silence, and the pod's launcher joins again once the link is back."""
    job = pods(["--step-s", "0.5"], train={"steps": 14, "micro_batch_size": 4},
               checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 2},
               launch={"kill_grace_s": 1.0, "max_restarts": 1}, telemetry={"interval_s": 0.2})
    node0, node1 = job.start(0), job.start(1)
    node0.wait_until(lambda: any("rank 1 host node1 step 5 " in line for line in node0.stdout), "step 5", timeout=240)
    if vanish == "killed":
        node1.proc.kill()
    else:
        _link(nodes.nodes[1], "down")
    killed = time.monotonic()
    try:
        node0.wait_until(lambda: any("lost contact with node1" in line for line in node0.stderr), "the loss",
                         timeout=60)
        noticed = time.monotonic() - killed
        print(f"{vanish}: node 0 noticed the vanished pod after {noticed:.1f} s")
        assert noticed < 30, node0.output
        node0.wait_until(lambda: any(line.startswith("zerorun: restart 1 of 1 on the same nodes, node1 included")
                                     for line in node0.stderr), "the restart", timeout=60)
        deadline = time.monotonic() + 60
        while node1.leftovers() and time.monotonic() < deadline:  # its node supervisor ends the workers by itself
            time.sleep(0.5)
        assert node1.leftovers() == [], [p.cmdline() for p in node1.leftovers()]
    finally:
        if vanish == "cut off":
            _link(nodes.nodes[1], "up")
    if vanish == "killed":
        node1 = job.start(1)  # the replacement pod
    else:
        assert any("lost contact with node 0 at recipe-0.recipe:29501: no heartbeat" in line for line in node1.stderr)
    assert node1.wait(timeout=240) == 0, node1.output + node0.output
    assert node0.wait(timeout=60) == 0, node0.output
    resumed = [line for line in node0.stdout if "rank 0 resumed from step-" in line]
    assert resumed and int(re.search(r"at step (\d+)", resumed[0]).group(1)) >= 4, node0.output
    assert any("rank 1 host node1 step 13 " in line for line in node0.stdout), node0.output
    assert node0.leftovers() == [] and node1.leftovers() == []
    assert os.path.exists(tmp_path / "ckpt" / "latest")
