"""`zerorun submit --to kubernetes`: write the manifests into the run directory, apply them, follow node 0.

    written = write("recipe.yaml", KubeOptions(nodes=4, gpus_per_node=8, image="ghcr.io/me/train:1"))
    apply(written)                 # kubectl: the Secret (created on kubectl's stdin), then the manifests
    exit_code = follow(written)    # node 0's log, as its launcher prints it, and its exit status

The manifests (`kubernetes.manifests`, pure) go to `runs/<name>/k8s/<kind>.yaml`: plain YAML to read,
keep, edit and `kubectl apply -f` again. The recipe is checked here first (a bad recipe fails now,
not in a pod), and named in the pods' command by the path given here: the image must hold the
recipe and the script at that path, relative to its working directory.

The job's secret is never written: `apply` makes a random one and sends the Secret to `kubectl create
-f -` on its stdin (an existing Secret of that name is kept), or `--secret NAME` names one the user made.
Following: node 0's launcher is the job's console, so its pod's log is the job's output; when it ends,
its container's exit status is the job's (every pod exits with it).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zerorun import config
from zerorun.errors import LaunchError
from zerorun.launch import kubernetes
from zerorun.launch.kubernetes import Kind, Pods, Volume
from zerorun.launch.node_role import DEFAULT_PORT
from zerorun.telemetry import RUNS_DIR

POLL_S = 2.0
_KUBECTL_TIMEOUT_S = 60.0
_ENDED = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class KubeOptions:
    """The options of `zerorun submit --to kubernetes` (the CLI maps its flags onto these one to one)."""

    nodes: int = 1
    image: str | None = None
    gpus_per_node: int | None = None
    kind: Kind = Kind.JOB
    volumes: Sequence[str] = field(default_factory=tuple)  # CLAIM:PATH
    secret: str | None = None  # an existing Secret with the job's secret under key `secret`
    namespace: str | None = None
    overrides: Sequence[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class Written:
    pods: Pods
    path: Path  # runs/<name>/k8s/<kind>.yaml


def plan_pods(recipe_path: str | Path, options: KubeOptions, cwd: Path) -> Pods:
    """The pods for `recipe_path`: the recipe checked, its name and rendezvous port taken; pure but for the read."""
    if not options.image:
        raise LaunchError("--image: which container image runs the pods? It must hold torch, zerorun, your script "
                          "and the recipe (e.g. --image ghcr.io/me/train:1).")
    if options.nodes < 1:
        raise LaunchError(f"--nodes: expected at least 1, got {options.nodes}.")
    if options.gpus_per_node is not None and options.gpus_per_node < 1:
        raise LaunchError(f"--gpus-per-node: expected at least 1, got {options.gpus_per_node}.")
    recipe = config.load(recipe_path, overrides=options.overrides)
    if recipe.hostfile:
        raise LaunchError(f"{recipe.given.get('hostfile', recipe.source)}: hostfile: the pods are the nodes; drop "
                          "the hostfile from the recipe (or --set hostfile=null).")
    path = Path(recipe_path)
    in_pod = os.path.relpath(path.resolve(), cwd) if path.resolve().is_relative_to(cwd) else str(path)
    return Pods(name=kubernetes.job_name(recipe.name or path.stem), nodes=options.nodes, image=options.image,
                recipe=in_pod, kind=options.kind, gpus_per_node=options.gpus_per_node,
                nproc_per_node=recipe.nproc_per_node, volumes=tuple(Volume.parse(v) for v in options.volumes),
                secret=options.secret, namespace=options.namespace, overrides=tuple(options.overrides),
                master_port=recipe.master_port or DEFAULT_PORT)


def write(recipe_path: str | Path, options: KubeOptions, runs_dir: str | Path = RUNS_DIR) -> Written:
    """Check the recipe and write the manifests into `runs/<name>/k8s/`."""
    cwd = Path.cwd().resolve()
    pods = plan_pods(recipe_path, options, cwd)
    directory = cwd / runs_dir / pods.name / "k8s"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{pods.kind.value}.yaml"
    path.write_text(kubernetes.describe(pods) + kubernetes.to_yaml(kubernetes.manifests(pods)))
    return Written(pods, path)


def apply_hint(written: Written) -> str:
    """How to start the written job by hand (when `--apply` was not asked)."""
    pods, ns = written.pods, _namespace(written.pods)
    apply_it = shlex.join(["kubectl", "apply", *ns, "-f", str(written.path)])
    if pods.secret:
        return apply_it
    create = shlex.join(["kubectl", "create", "secret", "generic", pods.secret_name, *ns,
                         f"--from-file={kubernetes.SECRET_KEY}=/dev/stdin"])
    return f"python -c 'import secrets; print(secrets.token_hex(32), end=\"\")' | {create}; {apply_it}"


def apply(written: Written) -> None:
    """Create the job's Secret (unless one was named), then apply the manifests; LaunchError if kubectl fails."""
    pods = written.pods
    if not pods.secret:
        secret = json.dumps(kubernetes.secret_manifest(pods, secrets.token_hex(32)))
        created = _kubectl(["create", *_namespace(pods), "-f", "-"], stdin=secret, check=False)
        if created.returncode != 0 and "AlreadyExists" not in created.stderr:
            raise LaunchError(f"kubectl could not create the Secret {pods.secret_name}: {_last_line(created)}")
        if created.returncode != 0:
            _say(f"the Secret {pods.secret_name} exists already: the job uses its secret")
    _kubectl(["apply", *_namespace(pods), "-f", str(written.path)])


def follow(written: Written, poll_s: float = POLL_S) -> int:
    """Node 0's log until its container ends, then its exit status (the job's)."""
    pods = written.pods
    selector = f"{kubernetes.LABEL}={pods.name},batch.kubernetes.io/job-completion-index=0"
    _say(f"waiting for node 0's pod ({selector})")
    pod, phase = _node0(pods, selector, poll_s)
    _say(f"following {pod} ({phase}); Ctrl-C stops following, the job goes on")
    try:
        subprocess.run(["kubectl", "logs", *_namespace(pods), "-f", pod], check=False)
        while phase not in _ENDED:
            time.sleep(poll_s)
            pod, phase = _node0(pods, selector, poll_s)
    except KeyboardInterrupt:
        _say(f"stopped following; the job goes on (`kubectl delete -f {written.path}` ends it)")
        return 130
    code = _kubectl(["get", "pod", *_namespace(pods), pod, "-o",
                     "jsonpath={.status.containerStatuses[0].state.terminated.exitCode}"]).stdout.strip()
    status = int(code) if code.lstrip("-").isdigit() else 1
    _say(f"{pod} {phase}; exit code {status}")
    return status


def _node0(pods: Pods, selector: str, poll_s: float) -> tuple[str, str]:
    """Node 0's pod and its phase, once it runs (or has ended)."""
    while True:
        listed = _kubectl(["get", "pods", *_namespace(pods), "-l", selector, "-o",
                           "jsonpath={range .items[*]}{.metadata.name} {.status.phase}{\"\\n\"}{end}"]).stdout
        for line in listed.splitlines():
            name, _, phase = line.partition(" ")
            if phase in ("Running", *_ENDED):
                return name, phase
        time.sleep(poll_s)


def _namespace(pods: Pods) -> list[str]:
    return ["--namespace", pods.namespace] if pods.namespace else []


def _kubectl(args: list[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """kubectl; its absence, a hang or (with `check`) a failure is a LaunchError naming the command."""
    if shutil.which("kubectl") is None:
        raise LaunchError("kubectl is not on PATH: --apply needs it (or apply the written manifests yourself).")
    try:
        if stdin is None:
            done = subprocess.run(["kubectl", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=_KUBECTL_TIMEOUT_S)
        else:
            done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True,
                                  timeout=_KUBECTL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"kubectl {shlex.join(args)} did not answer within {_KUBECTL_TIMEOUT_S:g} s.") from None
    if check and done.returncode != 0:
        raise LaunchError(f"kubectl {shlex.join(args)} failed: {_last_line(done)}")
    return done


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]


def _say(message: str) -> None:
    print(f"zerorun: {message}", file=sys.stderr, flush=True)
