"""Kubernetes manifests for a recipe: pure data, from the recipe's name and `zerorun submit`'s options.

    docs = manifests(Pods(name="gpt", nodes=4, image="ghcr.io/me/train:1", recipe="recipes/gpt.yaml",
                          gpus_per_node=8))            # [Service, Job] as plain dicts
    text = to_yaml(docs)                              # what runs/<name>/k8s/<kind>.yaml holds

Every pod runs the same command, `python -m zerorun.cli launch RECIPE`, and learns its place from the
environment the manifest sets (`PET_NNODES`, `PET_NPROC_PER_NODE`, `MASTER_ADDR`, `MASTER_PORT`) and
the one the cluster adds (`JOB_COMPLETION_INDEX`, or a TrainJob runtime's `PET_NODE_RANK`): every node
its own launcher (`peer_launch`), node 0's the job's console. Each kind:

- `job` (the default; any cluster): an Indexed `batch/v1` Job of N pods and a headless Service that
  gives them stable names (`<name>-<index>.<name>`; node 0 is `<name>-0.<name>`), published before
  the pods are ready, since node 0 must be reachable while it waits for the others.
- `jobset`: a JobSet (`jobset.x-k8s.io/v1alpha2`) of one replicated Job of the same shape; JobSet makes
  the headless Service (`<name>-node-0-0.<name>` is node 0).
- `trainjob`: a Kubeflow Trainer TrainJob (`trainer.kubeflow.org/v1alpha1`) on the `torch-distributed`
  runtime, which sets the PET_* variables itself; volumes go in as a runtime patch.

**One failure, one restart.** A worker that fails is restarted by zerorun inside the pods
(`--max-restarts`: every node's launcher stays and joins the next attempt); whatever zerorun exits
with after that ends the Job (`backoffLimit: 0`, and a pod failure policy that fails the Job on any
exit code), so the cluster never starts the job again on top of zerorun's restarts. A pod the cluster
takes away (its node lost, drained, preempted: the `DisruptionTarget` condition) is ignored by that
count and replaced; the new pod's launcher joins the job again, and the next attempt resumes from the
latest checkpoint. JobSet's own restarts are off (`failurePolicy.maxRestarts: 0`) for the same reason;
a TrainJob's are its runtime's.

Also in every pod: the GPUs (`nvidia.com/gpu` limits), a memory-backed `/dev/shm` (the container
runtime's default 64 MiB is too small for NCCL and zerorun's shared-memory collectives), each
`--volume CLAIM:PATH` as a PersistentVolumeClaim mounted at PATH (checkpoints), and the job's secret
from a Kubernetes Secret (`secretKeyRef`): the manifests name the Secret, never hold its value.
"""

from __future__ import annotations

import enum
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from zerorun.errors import LaunchError
from zerorun.launch.node_role import DEFAULT_PORT
from zerorun.launch.secret import SECRET_ENV

CONTAINER = "zerorun"
SECRET_KEY = "secret"  # the key of the job's secret in the Kubernetes Secret
GPU_RESOURCE = "nvidia.com/gpu"
LABEL = "zerorun.dev/job"
TRAIN_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for torch
TRAINJOB_NODE = "node"  # the replicated job (and container) a torch TrainingRuntime runs the trainer in
MAX_NAME = 40  # a pod's host name (`<name>-node-0-12`) must stay within a DNS label's 63 characters
_NAME = re.compile(r"[^a-z0-9-]+")


class Kind(str, enum.Enum):
    """What runs the pods."""

    JOB = "job"
    JOBSET = "jobset"
    TRAINJOB = "trainjob"


@dataclass(frozen=True)
class Volume:
    """`--volume CLAIM:PATH`: a PersistentVolumeClaim mounted at PATH in every pod."""

    claim: str
    path: str

    @classmethod
    def parse(cls, text: str) -> Volume:
        claim, sep, path = text.partition(":")
        if not sep or not valid_name(claim) or not path.startswith("/"):
            raise LaunchError(f"--volume {text}: expected CLAIM:PATH, a PersistentVolumeClaim's name (lowercase "
                              "letters, digits, '-') and an absolute path in the pod, e.g. ckpt:/ckpt.")
        return cls(claim, path)


@dataclass(frozen=True)
class Pods:
    """What the manifests describe: the job's pods and what each runs."""

    name: str  # a DNS label: the Job, Service and Secret are named after it (see `job_name`)
    nodes: int
    image: str
    recipe: str  # the recipe's path inside the image, as `zerorun launch` takes it there
    kind: Kind = Kind.JOB
    gpus_per_node: int | None = None
    nproc_per_node: int | None = None  # workers per pod (default: the GPUs, else the recipe's)
    volumes: tuple[Volume, ...] = ()
    secret: str | None = None  # the Kubernetes Secret holding the job's secret (default: <name>-secret)
    namespace: str | None = None
    overrides: Sequence[str] = field(default_factory=tuple)  # `--set KEY=VALUE`, passed on to every pod
    master_port: int = DEFAULT_PORT
    python: str = "python"

    @property
    def secret_name(self) -> str:
        return self.secret or f"{self.name}-secret"

    @property
    def master_addr(self) -> str:
        """Node 0's pod, by the name its headless Service gives it."""
        if self.kind is Kind.JOBSET:
            return f"{self.name}-{TRAINJOB_NODE}-0-0.{self.name}"
        return f"{self.name}-0.{self.name}"

    @property
    def workers(self) -> int | None:
        return self.nproc_per_node or self.gpus_per_node


def job_name(recipe_name: str) -> str:
    """A recipe's name as a Kubernetes name: lowercase letters, digits and '-', at most `MAX_NAME` characters."""
    name = _NAME.sub("-", recipe_name.lower()).strip("-")[:MAX_NAME].rstrip("-")
    if not name or not name[0].isalpha():
        name = f"zr-{name}".rstrip("-")
    return name


def valid_name(name: str) -> bool:
    return bool(re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name))


def pod_command(pods: Pods) -> list[str]:
    """What every pod runs: the same command (its place comes from the environment)."""
    return [pods.python, "-m", "zerorun.cli", "launch", pods.recipe,
            *(arg for override in pods.overrides for arg in ("--set", override))]


def pod_env(pods: Pods) -> list[dict[str, Any]]:
    """The pod's environment: where node 0 is, how many nodes and workers, and the secret by reference."""
    env: list[dict[str, Any]] = []
    if pods.kind is not Kind.TRAINJOB:  # a TrainJob's runtime sets the PET_* variables itself
        env += [_value("PET_NNODES", pods.nodes), _value("MASTER_ADDR", pods.master_addr),
                _value("MASTER_PORT", pods.master_port)]
        env += [_value("PET_NPROC_PER_NODE", pods.workers)] if pods.workers else []
    env.append({"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": pods.secret_name, "key": SECRET_KEY}}})
    return env


def _value(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def manifests(pods: Pods) -> list[dict[str, Any]]:
    """The documents `kubectl apply -f` takes for `pods.kind`."""
    if not valid_name(pods.name) or len(pods.name) > MAX_NAME:
        raise LaunchError(f"{pods.name!r} is not a Kubernetes name of at most {MAX_NAME} characters (lowercase "
                          "letters, digits and '-'); `job_name()` makes one from the recipe's name.")
    if pods.nodes < 1:
        raise LaunchError(f"--nodes: expected at least 1, got {pods.nodes}.")
    if pods.kind is Kind.JOBSET:
        return [_jobset(pods)]
    if pods.kind is Kind.TRAINJOB:
        return [_trainjob(pods)]
    return [_service(pods), _job(pods)]


def secret_manifest(pods: Pods, value: str) -> dict[str, Any]:
    """The Secret `--apply` creates (sent to kubectl on its stdin, never written to a file)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _metadata(pods, pods.secret_name), "stringData": {SECRET_KEY: value}}


def to_yaml(docs: Sequence[dict[str, Any]]) -> str:
    return "---\n".join(yaml.safe_dump(doc, sort_keys=False, default_flow_style=False) for doc in docs)


def describe(pods: Pods) -> str:
    """One comment block for the top of the file: what runs, and how to run a pod's part by hand."""
    return "\n".join([
        f"# Written by `zerorun submit --to kubernetes` for {pods.recipe}: {pods.nodes} pods ({pods.kind.value}),",
        "# each running the same command, its node rank from the cluster (JOB_COMPLETION_INDEX or PET_NODE_RANK):",
        f"#   {shlex.join(pod_command(pods))}",
        f"# The job's secret comes from the Secret {pods.secret_name!r} (key {SECRET_KEY!r}); it is not in this file.",
        "",
    ])


def _metadata(pods: Pods, name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": {LABEL: pods.name, "app.kubernetes.io/managed-by": "zerorun"}}
    if pods.namespace:
        metadata["namespace"] = pods.namespace
    return metadata


def _service(pods: Pods) -> dict[str, Any]:
    """Headless: no virtual IP, a DNS name per pod; published before the pods are ready (node 0 waits
    for the others while not ready)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(pods, pods.name),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {LABEL: pods.name},
                     "ports": _ports(pods, "port")}}


def _ports(pods: Pods, key: str) -> list[dict[str, Any]]:
    return [{"name": "rendezvous", key: pods.master_port}, {"name": "zerorun-link", key: pods.master_port + 1}]


def _job(pods: Pods) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(pods, pods.name), "spec": _job_spec(pods)}


def _job_spec(pods: Pods) -> dict[str, Any]:
    """N pods, one per node, each its own index; zerorun's exit status ends the Job, a disruption does not."""
    return {
        "completionMode": "Indexed", "completions": pods.nodes, "parallelism": pods.nodes,
        "backoffLimit": 0,
        "podReplacementPolicy": "Failed",  # a replaced pod starts once the old one is gone: one launcher per node rank
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}},
        ]},
        "template": {"metadata": {"labels": {LABEL: pods.name}}, "spec": _pod_spec(pods)},
    }


def _pod_spec(pods: Pods) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # restarts are zerorun's (`--max-restarts`) and the Job's, never the kubelet's
        "containers": [_container(pods, CONTAINER)],
        "volumes": _volumes(pods, shm=True),
    }
    if pods.kind is Kind.JOB:
        spec["subdomain"] = pods.name  # with the headless Service: <name>-<index>.<name> resolves
    return spec


def _container(pods: Pods, name: str) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": pods.image, "command": pod_command(pods),
                                 "env": pod_env(pods), "ports": _ports(pods, "containerPort"),
                                 "volumeMounts": _mounts(pods, shm=True)}
    if pods.gpus_per_node:
        container["resources"] = {"limits": {GPU_RESOURCE: pods.gpus_per_node}}
    return container


def _volumes(pods: Pods, shm: bool) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}] if shm else []
    return volumes + [{"name": f"vol-{i}", "persistentVolumeClaim": {"claimName": v.claim}}
                      for i, v in enumerate(pods.volumes)]


def _mounts(pods: Pods, shm: bool) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}] if shm else []
    return mounts + [{"name": f"vol-{i}", "mountPath": v.path} for i, v in enumerate(pods.volumes)]


def _jobset(pods: Pods) -> dict[str, Any]:
    job = {"metadata": {"labels": {LABEL: pods.name}}, "spec": _job_spec(pods)}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _metadata(pods, pods.name),
            "spec": {"network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": pods.name},
                     "failurePolicy": {"maxRestarts": 0},
                     "replicatedJobs": [{"name": TRAINJOB_NODE, "replicas": 1, "template": job}]}}


def _trainjob(pods: Pods) -> dict[str, Any]:
    """The trainer's image, command, env and GPUs in `spec.trainer`; /dev/shm and the volumes as a patch of
    the runtime's `node` job (its container is `node`)."""
    trainer: dict[str, Any] = {"image": pods.image, "command": pod_command(pods), "env": pod_env(pods),
                               "numNodes": pods.nodes}
    if pods.workers:
        trainer["numProcPerNode"] = pods.workers
    if pods.gpus_per_node:
        trainer["resourcesPerNode"] = {"limits": {GPU_RESOURCE: pods.gpus_per_node}}
    pod = {"metadata": {"labels": {LABEL: pods.name}}, "spec": {"volumes": _volumes(pods, shm=True),
                    "containers": [{"name": TRAINJOB_NODE, "volumeMounts": _mounts(pods, shm=True)}]}}
    patch = {"manager": "zerorun", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": TRAINJOB_NODE, "template": {"spec": {"template": pod}}}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _metadata(pods, pods.name),
            "spec": {"runtimeRef": {"name": TRAIN_RUNTIME}, "trainer": trainer, "runtimePatches": [patch]}}
