"""`zerorun launch recipe.yaml --nnodes N --node-rank R --master-addr HOST`: every node its own launcher.

    job = prepare("recipe.yaml", options, role)   # the recipe, this node's workers, a plan to show
    print(render(job))                            # --dry-run
    exit_code = run(job)                          # node 0: the job's launcher; the others: its members

Where the cluster starts a process on every node (a Kubernetes Job's pods, machines started some
other way) nothing needs SSH: each node runs the same command. Node 0's launcher is the job's, as
over SSH: it waits for the other nodes' launchers to join it (`joined.Roster`, over `link`), plans
the job on them, and runs it with the same supervisor, telemetry console, failure report and
restarts as any launch (`launcher.run`), each other node reached through its link
(`joined.JoinedTransport`) where SSH would reach it through ssh. Each other node's launcher
(`member`) plans its own command from its own recipe and what node 0 tells it (the job id, the
nodes, the batch shape), runs it under a node supervisor as a local node runs, and relays its
output to node 0; node 0 refuses a node whose recipe, node count or versions differ from its own.

The nodes share one secret (`secret`), from the environment: it admits the launchers to each other,
and the telemetry token comes from it. Only node 0 claims the run's directories (`ownership`); each
node checks its own capacity before it joins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from zerorun import config
from zerorun.config import Recipe
from zerorun.config.convert import to_dict
from zerorun.errors import LaunchError
from zerorun.launch import capacity, launcher, member, preflight
from zerorun.launch.devices import gpu_count
from zerorun.launch.hostfile import Node
from zerorun.launch.joined import Expected, JoinedTransport, Roster
from zerorun.launch.link import Attempt, Hello
from zerorun.launch.node_role import NodeRole
from zerorun.launch.plan import LaunchPlan, NodeCommand, plan
from zerorun.launch.plan import render as render_plan
from zerorun.launch.secret import take_secret, telemetry_token
from zerorun.launch.transport import LocalTransport, Transport
from zerorun.telemetry import ADDRESS_ENV


@dataclass(frozen=True)
class PeerJob:
    """One node's share of a job whose every node runs a launcher: its role, recipe and a plan to show."""

    role: NodeRole
    recipe: Recipe
    nproc: int  # this node's workers
    host: str  # this node's host name
    shown: LaunchPlan  # every node as far as this one knows (the others' hosts are placeholders)

    @property
    def world_size(self) -> int:
        """Assuming every node runs as many workers as this one (node 0 plans with what each says)."""
        return self.role.nnodes * self.nproc


def prepare(recipe_path: str | os.PathLike, options: launcher.LaunchOptions, role: NodeRole) -> PeerJob:
    """Load the recipe with the role's rendezvous and check this node's capacity; starts nothing."""
    chosen = [flag for flag, value in (("--hostfile", options.hostfile), ("--include", options.include),
                                       ("--exclude", options.exclude), ("--num-nodes", options.num_nodes),
                                       ("--launcher", options.launcher)) if value]
    if chosen:
        raise LaunchError(f"{', '.join(chosen)}: {role.origins['nnodes']} runs a launcher on every node, started "
                          "there (nothing over SSH or srun): leave out the hostfile flags and --launcher.")
    flags = [f"master_addr={role.master_addr}", f"master_port={role.master_port}"]
    flags += [f"launch.max_restarts={options.max_restarts}"] if options.max_restarts is not None else []
    recipe = config.load(recipe_path, overrides=[*options.overrides, *flags])
    if recipe.hostfile:
        raise LaunchError(f"{recipe.given.get('hostfile', recipe.source)}: hostfile: {role.origins['nnodes']} runs "
                          "a launcher on every node; drop the hostfile from the recipe (or launch without --nnodes).")
    gpus = gpu_count()
    nproc = options.num_gpus or role.nproc_per_node or recipe.nproc_per_node or gpus or 2
    host = socket.gethostname()
    hosts = [host if rank == role.node_rank else f"<node {rank}>" for rank in range(role.nnodes)]
    shown = plan(recipe, [Node(h, tuple(range(nproc))) for h in hosts], launcher.new_job_id(recipe.name or "job"),
                 role.master_port, launcher.machine_facts(os.cpu_count() or 1), joined=True)
    here = dataclasses.replace(shown.nodes[role.node_rank], host="localhost")  # capacity counts local nodes
    origin = launcher.workers_origin(recipe, options) if not role.nproc_per_node or options.num_gpus else \
        role.origins["nproc_per_node"]
    capacity.check([here], capacity.this_machine(gpus), recipe.launch.oversubscribe, origin)
    return PeerJob(role, recipe, nproc, host, shown)


def render(job: PeerJob) -> str:
    """The `--dry-run` text: the plan as this node sees it."""
    role = job.role
    head = (f"node {role.node_rank} of {role.nnodes} ({job.host}), each node its own launcher: node 0's listens on "
            f"{role.master_addr}:{role.link_port} for the others; the host names of the other nodes are learnt "
            "when they join, and node 0 chooses the job id")
    return head + "\n" + render_plan(job.shown)


def run(job: PeerJob) -> int:
    """Run this node's part of the job to its end; the exit code is the job's (the same on every node)."""
    secret = take_secret(os.environ) if job.role.nnodes > 1 else None
    try:
        if job.role.is_first:
            return _run_first(job, secret)
        assert secret is not None
        return member.run(job.recipe, job.role, job.host, job.nproc, secret, hello(job))
    except KeyboardInterrupt:
        return 130


def hello(job: PeerJob) -> Hello:
    return Hello(job.role.node_rank, job.role.nnodes, job.host, job.nproc, recipe_digest(job.recipe),
                 preflight.local_facts())


def recipe_digest(recipe: Recipe) -> str:
    """The recipe as every node must have it: paths reduced to their names (checkouts may lie apart)."""
    data = to_dict(recipe)
    for key in ("script", "deepspeed_config"):
        if data.get(key):
            data[key] = os.path.basename(data[key])
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _run_first(job: PeerJob, secret: str | None) -> int:
    """Node 0: wait for the others, plan the job on them, and run it as the job's launcher."""
    role = job.role
    if secret is None:  # a job of one node: nothing joins
        return launcher.run(_planned(job, {0: (job.host, job.nproc)}), _Peers(job, None, "", None))
    roster = Roster(role, secret, Expected(role.nnodes, recipe_digest(job.recipe), preflight.local_facts(), job.host),
                    _say)
    roster.start()
    exit_code = 1
    try:
        others = "node 1" if role.nnodes == 2 else f"nodes 1-{role.nnodes - 1}"
        _say(f"node 0 of {role.nnodes} ({job.host}): waiting for {others} to join at {roster.address}")
        members = roster.wait(range(1, role.nnodes), job.recipe.launch.join_timeout_s)
        _say(f"every node joined: {', '.join(m.hello.host for m in members.values())}")
        nodes = {0: (job.host, job.nproc), **{rank: (m.hello.host, m.hello.nproc) for rank, m in members.items()}}
        exit_code = launcher.run(_planned(job, nodes), _Peers(job, roster, telemetry_token(secret), role.master_addr))
        return exit_code
    finally:
        roster.end(exit_code)


def _planned(job: PeerJob, nodes: dict[int, tuple[str, int]]) -> LaunchPlan:
    hosts = [Node(host, tuple(range(nproc))) for _, (host, nproc) in sorted(nodes.items())]
    facts = job.shown.inputs.facts if job.shown.inputs is not None else launcher.machine_facts(os.cpu_count() or 1)
    return plan(job.recipe, hosts, job.shown.job_id, job.role.master_port, facts, joined=True)


class _Peers:
    """Node 0's reach: its own node as a local process, every other through the link its launcher joined by."""

    def __init__(self, job: PeerJob, roster: Roster | None, token: str | None, advertise: str | None) -> None:
        self.job = job
        self.roster = roster
        self.telemetry_token = token or None
        self.telemetry_host = advertise

    def transports(self, launch_plan: LaunchPlan) -> list[Transport]:
        roster = self.roster
        python = sys.executable
        if roster is None:
            return [LocalTransport(launch_plan.nodes[0].host, launch_plan.job_id, python, launch_plan.kill_grace_s)]
        ranks = [roster.rank_of(node.host) for node in launch_plan.nodes]
        for rank in set(range(1, self.job.role.nnodes)) - set(ranks):
            roster.drop(rank, f"node {rank} was left out of the job after it was lost (launch.on_node_failure: shrink)")
        members = roster.wait([rank for rank in ranks if rank], self.job.recipe.launch.join_timeout_s)
        attempt = _attempt_of(launch_plan)
        grace = launch_plan.kill_grace_s
        return [LocalTransport(node.host, launch_plan.job_id, python, grace) if rank == 0 else
                JoinedTransport(members[rank], launch_plan.job_id, grace, attempt)
                for node, rank in zip(launch_plan.nodes, ranks)]


def _attempt_of(launch_plan: LaunchPlan) -> Callable[[NodeCommand], Attempt]:
    """What each node is told to run: enough to plan the same attempt from its own recipe."""
    assert launch_plan.inputs is not None
    train = launch_plan.inputs.recipe.train
    nodes = [(node.host, node.nproc) for node in launch_plan.nodes]

    def attempt(node: NodeCommand) -> Attempt:
        return Attempt(launch_plan.job_id, node.node_rank, nodes, launch_plan.master_port, train.micro_batch_size,
                       train.grad_accum_steps, node.env.get(ADDRESS_ENV))
    return attempt


def _say(message: str) -> None:
    print(f"zerorun: {message}", file=sys.stderr, flush=True)
