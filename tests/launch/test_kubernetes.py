"""Kubernetes manifests: valid against Kubernetes' own schemas, restarts that never multiply, the secret never
written, and a pod's command + environment that make exactly the role the node needs."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from tests.launch.launched import write_recipe
from zerorun.errors import LaunchError
from zerorun.launch import k8s_submit, kubernetes
from zerorun.launch.kubernetes import Kind, Pods, Volume
from zerorun.launch.node_role import RoleFlags, node_role

kubernetes_validate = pytest.importorskip("kubernetes_validate")
VERSIONS = ("1.29", kubernetes_validate.latest_version())  # podReplacementPolicy and podFailurePolicy: 1.29 and later
PODS = Pods(name="gpt", nodes=3, image="ghcr.io/me/train:1", recipe="recipes/gpt.yaml", gpus_per_node=8,
            volumes=(Volume("ckpt", "/ckpt"),), overrides=("zero.stage=3",))


def pod_template(doc: dict) -> dict:
    spec = doc["spec"]
    return spec["replicatedJobs"][0]["template"]["spec"]["template"] if doc["kind"] == "JobSet" else spec["template"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_indexed_job_and_its_service_validate_against_kubernetes_schemas(version):
    docs = kubernetes.manifests(PODS)
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    jobset = kubernetes.manifests(Pods(**{**PODS.__dict__, "kind": Kind.JOBSET}))[0]  # its child Job, as a Job
    child = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "child"},
             **jobset["spec"]["replicatedJobs"][0]["template"]}
    kubernetes_validate.validate(child, version, strict=True)


def test_one_failure_is_restarted_once_zerorun_restarts_workers_and_the_job_only_replaces_lost_pods():
    service, job = kubernetes.manifests(PODS)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == \
        ("Indexed", 3, 3, 0)
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "zerorun", "operator": "NotIn", "values": [0]}}]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == service["metadata"]["name"] == "gpt"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == spec["template"]["metadata"]["labels"]
    jobset = kubernetes.manifests(Pods(**{**PODS.__dict__, "kind": Kind.JOBSET}))[0]
    assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 0}
    child = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert {k: v for k, v in child.items() if k != "template"} == {k: v for k, v in spec.items() if k != "template"}


@pytest.mark.parametrize("kind", list(Kind))
def test_every_pod_gets_the_gpus_a_memory_backed_shm_the_volume_and_the_secret_by_reference(kind):
    doc = kubernetes.manifests(Pods(**{**PODS.__dict__, "kind": kind}))[-1]
    if kind is Kind.TRAINJOB:
        trainer = doc["spec"]["trainer"]
        patch = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod, env, resources = patch["template"]["spec"]["template"], trainer["env"], trainer["resourcesPerNode"]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
    else:
        pod = pod_template(doc)
        container = pod["spec"]["containers"][0]
        env, resources, mounts = container["env"], container["resources"], container["volumeMounts"]
    assert resources == {"limits": {"nvidia.com/gpu": 8}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
    assert {"name": "vol-0", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["spec"]["volumes"]
    assert [m["mountPath"] for m in mounts] == ["/dev/shm", "/ckpt"]
    assert {"name": "ZERORUN_JOB_SECRET",
            "valueFrom": {"secretKeyRef": {"name": "gpt-secret", "key": "secret"}}} in env


def test_the_trainjob_uses_the_fields_of_kubeflow_trainers_crd():
    """Structural (the TrainJob CRD is not shipped): the field names of trainer.kubeflow.org/v1alpha1 (v2.2+), and
    the pieces that are Kubernetes types validate as such."""
    doc = kubernetes.manifests(Pods(**{**PODS.__dict__, "kind": Kind.TRAINJOB}))[0]
    assert (doc["apiVersion"], doc["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    spec = doc["spec"]
    assert set(spec) <= {"runtimeRef", "trainer", "runtimePatches", "suspend", "managedBy", "initializer",
                         "activeDeadlineSeconds"}
    assert spec["runtimeRef"] == {"name": "torch-distributed"}
    assert set(spec["trainer"]) <= {"image", "command", "args", "env", "numNodes", "numProcPerNode",
                                    "resourcesPerNode"}
    assert (spec["trainer"]["numNodes"], spec["trainer"]["numProcPerNode"]) == (3, 8)
    assert [e["name"] for e in spec["trainer"]["env"]] == ["ZERORUN_JOB_SECRET"]  # the runtime sets PET_*
    patch = spec["runtimePatches"][0]
    assert patch["manager"] == "zerorun" and set(patch) == {"manager", "trainingRuntimeSpec"}
    job = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    assert job["name"] == "node" and set(job["template"]["spec"]) == {"template"}
    pod = job["template"]["spec"]["template"]
    assert pod["spec"]["containers"][0]["name"] == "node"
    container = {"name": "node", **{k: spec["trainer"][k] for k in ("image", "command", "env")},
                 "resources": spec["trainer"]["resourcesPerNode"]}
    for version in VERSIONS:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                                      "spec": {**pod["spec"], "containers": [container]}}, version, strict=True)


@pytest.mark.parametrize("kind, index, rank_env", [(Kind.JOB, 2, "JOB_COMPLETION_INDEX"),
                                                    (Kind.JOBSET, 2, "JOB_COMPLETION_INDEX")])
def test_a_pods_command_and_environment_make_the_role_of_its_index(kind, index, rank_env):
    pods = Pods(**{**PODS.__dict__, "kind": kind})
    container = pod_template(kubernetes.manifests(pods)[-1])["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e} | {rank_env: str(index)}
    role = node_role(RoleFlags(), env)
    assert (role.nnodes, role.node_rank, role.master_addr, role.master_port, role.nproc_per_node) == \
        (3, index, pods.master_addr, 29500, 8)
    assert container["command"] == ["python", "-m", "zerorun.cli", "launch", "recipes/gpt.yaml", "--set",
                                    "zero.stage=3"]
    assert role.link_port in [p["containerPort"] for p in container["ports"]]


def test_names_become_kubernetes_names_and_bad_volumes_are_refused():
    assert kubernetes.job_name("My_GPT run.v2") == "my-gpt-run-v2"
    assert kubernetes.job_name("7b") == "zr-7b" and len(kubernetes.job_name("x" * 99)) == kubernetes.MAX_NAME
    for bad in ("ckpt", "Ckpt:/x", "ckpt:relative"):
        with pytest.raises(LaunchError, match=f"--volume {bad}: expected CLAIM:PATH"):
            Volume.parse(bad)


def fake_kubectl(directory: Path) -> Path:
    """A kubectl that records each call (argv and stdin) and answers like a cluster whose node 0 ran and exited 3."""
    log = directory / "calls.jsonl"
    script = directory / "kubectl"
    script.write_text(f"""#!/usr/bin/env python3
import json, sys
args = sys.argv[1:]
stdin = sys.stdin.read() if "-f" in args and args[args.index("-f") + 1] == "-" else None
with open({str(log)!r}, "a") as f:
    f.write(json.dumps({{"args": args, "stdin": stdin}}) + "\\n")
if args[:2] == ["get", "pods"]:
    print("gpt-0-abcde Failed")
elif args[:2] == ["get", "pod"]:
    print("3", end="")
elif args[:1] == ["logs"]:
    print("[gpt-0:0] hello from node 0")
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return log


def test_submit_writes_the_manifests_and_apply_creates_the_secret_only_on_kubectls_stdin(tmp_path, monkeypatch, capfd):
    log = fake_kubectl(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path, "train_tiny.py", name="gpt")
    written = k8s_submit.write(recipe.name, k8s_submit.KubeOptions(nodes=2, image="img:1", volumes=("ckpt:/ckpt",)))
    assert written.path == tmp_path / "runs/gpt/k8s/job.yaml"
    docs = list(yaml.safe_load_all(written.path.read_text()))
    assert [d["kind"] for d in docs] == ["Service", "Job"] and docs[1]["spec"]["completions"] == 2
    k8s_submit.apply(written)
    assert k8s_submit.follow(written, poll_s=0.01) == 3
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["args"][:2] for c in calls[:2]] == [["create", "-f"], ["apply", "-f"]]
    secret = json.loads(calls[0]["stdin"])
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "gpt-secret"
    value = secret["stringData"]["secret"]
    assert len(value) == 64
    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and p != log and value in p.read_text(errors="replace")]
    assert leaked == [] and all(value not in " ".join(c["args"]) for c in calls)
    assert "[gpt-0:0] hello from node 0" in capfd.readouterr().out
