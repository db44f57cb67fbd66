"""The launch plan: for every node, the exact command and environment that starts its workers.

`plan()` is a pure function of the recipe, the selected nodes and a few facts about the machines
(CPU count, whether slots are GPUs, the inherited environment). Keeping it pure means `--dry-run`
prints exactly what a real launch would run, and tests check argv and env without starting
anything. Everything impure (reading the hostfile, picking a free port, probing for GPUs) happens
in `zerorun.launch.launcher`, and running the commands is the job of a `Transport`.

Each node runs torchrun with a *static* rendezvous (`--rdzv-backend static` plus `--master-addr`,
`--master-port`, `--node-rank`): the launcher already knows every node and its rank, so no node
has to discover the others, and node i's workers get global ranks `first_rank + local_rank`.
torchrun starts `python -m zerorun.launch.worker -- script args` (its `-m`/`--module` flag) on
each local rank; `--max-restarts 0` because a failed rank ends the job (restarts are a decision
for the user, not a silent retry).

Inside a Slurm allocation the whole job is one srun step instead, planned by
`zerorun.launch.slurm.plan_step` on top of `plan()`.

A node on another host runs the same command over SSH (see `zerorun.launch.ssh`). It does not
inherit the launcher's environment, so its `env` also carries what a remote shell would lack:
PATH, LD_LIBRARY_PATH, PYTHONPATH, the active virtualenv or conda prefix, and every NCCL_* and
CUDA_* variable but CUDA_VISIBLE_DEVICES (which names the launcher's GPUs). Every node also gets
the `.zerorun_env` file's variables. Precedence, lowest first: propagated variables, `.zerorun_env`,
zerorun's defaults, the recipe's `env`, ZERORUN_*.

Slots travel as they were selected (`--include host:0,2` is slots 0 and 2 on `host`), whatever
GPUs the launching machine has: each node maps them onto its own devices (`zerorun.launch.devices`).
So do the directories of the node's NVMe offload files, which its supervisor removes at the end.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zerorun import config, offload_files
from zerorun.config import Recipe, SSHConfig, TelemetryConfig
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV
from zerorun.launch.hostfile import Node
from zerorun.telemetry import ADDRESS_ENV, RUNS_DIR, TOKEN_ENV

WORKER_MODULE = "zerorun.launch.worker"
TORCHRUN_MODULE = "zerorun.launch.torchrun"  # torch.distributed.run, its ranks forked warm (launch/warm.py)
RECIPE_SOURCE_ENV = config.RECIPE_ENV + "_SOURCE"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
PROPAGATED_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX",
                  "ZERORUN_WARM_RANKS")  # `ZERORUN_WARM_RANKS=0 zerorun launch ...` holds on every node
PROPAGATED_ENV_PREFIXES = ("NCCL_", "CUDA_")
NOT_PROPAGATED = frozenset({"CUDA_VISIBLE_DEVICES"})  # the launcher's GPUs, not the node's


@dataclass(frozen=True)
class MachineFacts:
    """What `plan()` needs to know about the machines, gathered by the caller.

    Remote nodes are assumed to look like the launching machine (same CPU count, same Python
    path), as DeepSpeed and torchrun also assume; their GPUs are their own (see `devices`).
    """

    cpu_count: int
    python: str  # the interpreter that runs torchrun on every node
    inherited_env: Mapping[str, str] = field(default_factory=dict)  # the launcher's environment
    cwd: str = "."  # the working directory, the same on every node
    env_file: Mapping[str, str] = field(default_factory=dict)  # the `.zerorun_env` variables
    hostname: str = "localhost"  # how other hosts reach this one (the rendezvous, when node 0 is local)


@dataclass(frozen=True)
class NodeCommand:
    """One node's share of the job: the command to run there and the variables zerorun sets."""

    host: str
    node_rank: int
    first_rank: int  # global rank of this node's local rank 0
    nproc: int
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added on top of the environment the transport inherits
    over_ssh: bool = False  # started through `ssh host` rather than as a local process
    cwd: str = "."
    step_nodes: tuple[str, ...] = ()  # a Slurm step (argv is srun's): one torchrun on each of these nodes
    slots: tuple[int, ...] = ()  # the node's selected GPU indices, mapped onto its devices there
    offload_dirs: tuple[str, ...] = ()  # its ranks' NVMe offload directories, removed when the job ends

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)

    @property
    def node_count(self) -> int:
        return len(self.step_nodes) or 1


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was made from, so that a restart can plan again (fewer nodes, another batch shape)."""

    recipe: Recipe
    nodes: tuple[Node, ...]
    facts: MachineFacts
    allocation: Any = None  # a Slurm step's: zerorun.launch.slurm.Allocation (typed there, to keep plan pure)
    joined: bool = False  # every node runs its own launcher (`peer_launch`): none is reached over SSH


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch will do, before anything has started."""

    job_id: str
    name: str
    master_addr: str
    master_port: int
    world_size: int
    kill_grace_s: float
    nodes: tuple[NodeCommand, ...]
    # The steps the script runs, as far as the launcher knows: the train.steps the user gave for a zerorun script,
    # None otherwise (its own loop; launch.deepspeed_compat: the engine says once it knows).
    steps: int | None = None
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    ssh: SSHConfig = field(default_factory=SSHConfig)
    nvme_paths: Mapping[str, str] = field(default_factory=dict)  # recipe key -> NVMe offload directory
    inputs: PlanInputs | None = field(default=None, compare=False, repr=False)


def plan(recipe: Recipe, nodes: Sequence[Node], job_id: str, master_port: int, facts: MachineFacts,
         joined: bool = False) -> LaunchPlan:
    """Build the per-node commands for `recipe` on `nodes` (in node-rank order); `joined`: every node
    runs its own launcher, which starts its command where it is (nothing over SSH)."""
    assert nodes, "plan: at least one node is needed"
    master_addr = recipe.master_addr or _address_of(nodes[0].host)
    if is_local(nodes[0].host) and not all(is_local(node.host) for node in nodes) and not recipe.master_addr:
        master_addr = facts.hostname  # 127.0.0.1 would mean each remote host itself
    recipe_json = config.to_json(recipe)
    commands = []
    first_rank = 0
    for node_rank, node in enumerate(nodes):
        argv = torchrun_argv(facts.python, len(nodes), node_rank, node.nproc, master_addr, master_port,
                             recipe.script, recipe.args)
        over_ssh = not joined and runs_over_ssh(node.host, recipe.launch.transport)
        env = node_env(recipe, node, job_id, recipe_json, facts, over_ssh)
        ranks = range(first_rank, first_rank + node.nproc)
        commands.append(NodeCommand(node.host, node_rank, first_rank, node.nproc, argv, env, over_ssh, facts.cwd,
                                    slots=node.slots, offload_dirs=offload_dirs(recipe, job_id, ranks)))
        first_rank += node.nproc
    return LaunchPlan(job_id=job_id, name=recipe.name or "job", master_addr=master_addr, master_port=master_port,
                      world_size=first_rank, kill_grace_s=recipe.launch.kill_grace_s, nodes=tuple(commands),
                      steps=None if recipe.launch.deepspeed_compat else config.known_steps(recipe),
                      telemetry=recipe.telemetry, ssh=recipe.ssh,
                      nvme_paths=nvme_paths(recipe), inputs=PlanInputs(recipe, tuple(nodes), facts, joined=joined))


def with_env(launch_plan: LaunchPlan, extra: Mapping[str, str]) -> LaunchPlan:
    """The same plan with `extra` added to every node's environment (what only exists at launch,
    such as the telemetry collector's address)."""
    nodes = tuple(dataclasses.replace(node, env={**node.env, **extra}) for node in launch_plan.nodes)
    return dataclasses.replace(launch_plan, nodes=nodes)


def torchrun_argv(python: str, nnodes: int, node_rank: int | str, nproc: int, master_addr: str, master_port: int,
                  script: str, args: Sequence[str]) -> tuple[str, ...]:
    """`python -m zerorun.launch.torchrun ... -m zerorun.launch.worker -- script args` for one node: torchrun's
    own arguments, for torchrun with its ranks forked from a zygote (`warm`).

    Only flags that torchrun has accepted in this spelling since torch 2.x are used. `node_rank` may
    be a placeholder that the node fills in (a Slurm step runs one command on every node).
    """
    return (
        python, "-m", TORCHRUN_MODULE,
        "--nnodes", str(nnodes),
        "--node-rank", str(node_rank),
        "--nproc-per-node", str(nproc),
        "--rdzv-backend", "static",
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--max-restarts", "0",
        "--monitor-interval", "0.1",
        "-m", WORKER_MODULE, "--", script, *args,
    )


def node_env(recipe: Recipe, node: Node, job_id: str, recipe_json: str, facts: MachineFacts,
             over_ssh: bool = False) -> dict[str, str]:
    """The variables zerorun sets for one node's torchrun (and so for its workers).

    The recipe's `env` overrides zerorun's defaults (OMP_NUM_THREADS) but not the ZERORUN_*
    variables the worker bootstrap depends on.
    """
    env: dict[str, str] = propagated_env(facts.inherited_env) if over_ssh else {}
    env.update(facts.env_file)
    if "OMP_NUM_THREADS" not in facts.inherited_env:
        # torchrun would otherwise force 1 thread per worker (with a warning); share the cores instead.
        env["OMP_NUM_THREADS"] = str(max(1, facts.cpu_count // node.nproc))
    env.update(recipe.env)
    if recipe.launch.backend != "auto":
        env[config.BACKEND_ENV] = recipe.launch.backend
    env[config.RECIPE_ENV] = recipe_json
    env[RECIPE_SOURCE_ENV] = recipe.source or ""
    env[JOB_ID_ENV] = job_id
    env[NODE_HOST_ENV] = node.host
    return env


def propagated_env(inherited: Mapping[str, str]) -> dict[str, str]:
    """What a remote node gets from the launcher's environment (a login shell there would lack it)."""
    return {key: value for key, value in inherited.items()
            if (key in PROPAGATED_ENV or key.startswith(PROPAGATED_ENV_PREFIXES)) and key not in NOT_PROPAGATED}


def nvme_paths(recipe: Recipe) -> dict[str, str]:
    """Recipe key -> directory, for each kind of state the recipe offloads to NVMe."""
    offloads = {"zero.offload_optimizer.nvme_path": recipe.zero.offload_optimizer,
                "zero.offload_param.nvme_path": recipe.zero.offload_param}
    return {key: off.nvme_path for key, off in offloads.items() if off.device == "nvme" and off.nvme_path}


def offload_dirs(recipe: Recipe, job_id: str, ranks: range) -> tuple[str, ...]:
    """The NVMe offload directories of these ranks in this job (none unless the recipe offloads to NVMe)."""
    paths = sorted(set(nvme_paths(recipe).values()))
    return tuple(str(offload_files.rank_dir(path, job_id, rank)) for path in paths for rank in ranks)


def runs_over_ssh(host: str, transport: str) -> bool:
    """Whether a node on `host` is started over SSH (`launch.transport: ssh` forces it for every host;
    under `slurm`, srun reaches every node)."""
    return transport == "ssh" or (transport != "slurm" and not is_local(host))


def render(launch_plan: LaunchPlan) -> str:
    """The `--dry-run` text: per node, its host, ranks, the variables zerorun sets and the command."""
    p = launch_plan
    count = sum(node.node_count for node in p.nodes)
    nodes = f"{count} node{'s' if count != 1 else ''}"
    lines = [f"job {p.job_id} ({p.name}): {nodes}, {p.world_size} workers, master {p.master_addr}:{p.master_port}"]
    if any(not node.step_nodes for node in p.nodes):
        lines.append("slots: GPU indices on each node, mapped there onto its own devices (CUDA_VISIBLE_DEVICES); "
                     "on a node without GPUs they only count workers")
    if p.telemetry.enabled:
        lines.append(f"telemetry: {RUNS_DIR}/{p.name}/telemetry.jsonl; every node's env also gets "
                     f"{ADDRESS_ENV}=<the launcher's collector, host:port chosen at launch>")
    for node in p.nodes:
        lines.append("")
        lines.append(_heading(node))
        lines.append("  env:")
        for key in sorted(node.env):
            lines.append(f"    {key}={_shown_value(key, node.env[key])}")
        lines.append("  command:")
        lines.append(f"    {shlex.join(node.argv)}")
        if node.offload_dirs:
            lines.append("  NVMe offload files, removed when the job ends:")
            lines.extend(f"    {directory}" for directory in node.offload_dirs)
    return "\n".join(lines)


def _heading(node: NodeCommand) -> str:
    if node.step_nodes:
        expanded = f" ({', '.join(node.step_nodes)})" if node.step_nodes != (node.host,) else ""
        return (f"srun step on {node.host}{expanded}: {node.nproc // node.node_count} workers "
                f"per node, ranks {_span(node.ranks)}; each node sets --node-rank from SLURM_NODEID and "
                f"{NODE_HOST_ENV} from SLURMD_NODENAME")
    how = f"  over ssh, in {node.cwd}" if node.over_ssh else ""
    return f"node {node.node_rank}: {node.host}  ranks {_span(node.ranks)}  slots {','.join(map(str, node.slots))}{how}"


def _shown_value(key: str, value: str) -> str:
    if key == TOKEN_ENV:
        return "<the job's telemetry secret>"
    if key == config.RECIPE_ENV:  # a long JSON blob: say what it is instead of flooding the screen
        return f"<the resolved recipe as JSON, {len(value)} bytes>"
    return shlex.quote(value)


def _span(ranks: range) -> str:
    return str(ranks.start) if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"


def _address_of(host: str) -> str:
    """The rendezvous address for a host name (loopback stays IPv4 so that gloo binds the same way)."""
    return "127.0.0.1" if host in LOCAL_HOSTS else host


def is_local(host: str) -> bool:
    return host in LOCAL_HOSTS
