"""Slurm: inside an allocation, one `srun` step starts a torchrun agent on every allocated node.

On a Slurm cluster the nodes come from the allocation, not from a hostfile, and SSH between nodes
may be forbidden. Inside an allocation (`salloc`, or an sbatch script: SLURM_JOB_ID is set),
`zerorun launch` therefore plans one step for the whole job:

    allocation = read_allocation(os.environ)       # nodes (`scontrol show hostnames`), tasks, GPUs, CPUs
    launch_plan = plan_step(recipe, allocation, nproc, job_id, port, facts)      # pure: srun's argv + env
    SlurmTransport(...)                            # the supervisor runs the step as one "node"

    srun --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1 --job-name=<zerorun job id>
         python -m zerorun.launch.slurm --kill-grace-s G --
         python -m torch.distributed.run --nnodes N --node-rank '$SLURM_NODEID' ... -m zerorun.launch.worker -- script

srun runs one command on every node, so the node-specific parts are filled in there, by this
module's `main` (the *node entry*): `--node-rank` from SLURM_NODEID and the host of the
`[host:rank]` prefixes from SLURMD_NODENAME. The rendezvous is static on the first node, as with a
hostfile. srun gives the step every CPU and GPU the job has on its nodes, and passes the launcher's
environment on (the recipe, the telemetry address); Slurm itself sets CUDA_VISIBLE_DEVICES. The
recipe travels in pieces of 64 KiB (ZERORUN_RECIPE_PART_0, _1, ...: one variable holds at most 128 KiB
on Linux, and srun could not start with a larger recipe); the node entry joins them and its node
supervisor hands the workers the recipe in a 0600 file of the job's, as on every other node.

Workers per node: the recipe's `nproc_per_node` (or `--num-gpus`), else the allocation's GPUs per
node, else its tasks per node (SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE, which must then be
the same on every node). `zerorun submit` asks for `--ntasks-per-node` accordingly.

Teardown, with the same no-orphans guarantee as the other transports:
- The node entry runs torchrun like every node supervisor does (`node.run_node`): on SIGTERM
  it ends every process of the job on its node, SIGKILL after `kill_grace_s` included, and also
  the ones that left torchrun's tree (found by the job id in their environment).
- A failing rank's exit record reaches the supervisor through srun's output, which stops the step.
  `--kill-on-bad-exit=1` also ends the step when a node fails while no launcher is watching.
- Stopping the step is `scancel --signal=TERM JOB.STEP` (the step is found by its name, the
  zerorun job id): every process of the step gets SIGTERM and each node entry cleans up. Not a
  signal to srun: srun answers SIGTERM (and a double SIGINT) with SIGKILL to the whole step, which
  would leave the node entries no time. If the step outlives the grace period: `scancel JOB.STEP`,
  then srun is killed (Slurm then ends the step). Slurm's KillWait must exceed `kill_grace_s`.
- If the launcher dies (even by SIGKILL), srun gets SIGUSR2 as its parent-death signal and forwards
  it to the step like any signal it has no use for; the node entries take it as the order to stop.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import IO

from zerorun import offload_files
from zerorun.config import RECIPE_ENV, Recipe
from zerorun.errors import LaunchError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV
from zerorun.launch.hostfile import Node
from zerorun.launch.node import NodeJob, StopOrder, run_node
from zerorun.launch.plan import LaunchPlan, MachineFacts, NodeCommand, plan, torchrun_argv
from zerorun.launch.processes import KILL_WAIT_S, die_with_parent
from zerorun.launch.transport import Transport

NODE_MODULE = "zerorun.launch.slurm"
NODE_RANK = "$SLURM_NODEID"  # in the step's command: each node's entry puts its own node index there
LAUNCHER_GONE = signal.SIGUSR2  # srun's parent-death signal: srun forwards it to the step as it is
_STEP_LOOKUP_S = 3.0  # how long stop() looks for a step that srun may not have registered yet
_SLURM_TIMEOUT_S = 10.0
RECIPE_PART_ENV = RECIPE_ENV + "_PART_"  # srun's environment carries the recipe as _PART_0, _PART_1, ...
_RECIPE_PART_CHARS = 64 << 10  # the recipe's JSON is ASCII: 64 KiB a variable, half of Linux's limit for one


# ---------------------------------------------------------------------------------------------
# The allocation (pure parsing, plus `scontrol show hostnames`)


@dataclass(frozen=True)
class Allocation:
    """What the job was given, from the SLURM_* variables of a process inside it."""

    job_id: str
    nodelist: str  # as Slurm writes it, e.g. gpu[01-04]
    nodes: tuple[str, ...]  # expanded, in Slurm's order (node 0 first)
    tasks_per_node: tuple[int, ...]  # one count per node
    gpus_per_node: int  # 0: no GPUs allocated
    cpus_per_node: tuple[int, ...]  # one count per node (empty: unknown)


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID"))


def read_allocation(env: Mapping[str, str], hostnames: Callable[[str], list[str]] | None = None) -> Allocation:
    """The allocation this process runs in; `hostnames` expands a nodelist (default: scontrol)."""
    if not in_allocation(env):
        raise LaunchError("not inside a Slurm allocation (SLURM_JOB_ID is not set): run inside `salloc` or an "
                          "sbatch script, or submit the job with `zerorun submit`.")
    step_tasks = env.get("SLURM_STEP_NUM_TASKS", "1")
    if step_tasks.isdigit() and int(step_tasks) > 1:
        raise LaunchError(f"zerorun launch runs here as task {env.get('SLURM_PROCID', '?')} of an srun step of "
                          f"{step_tasks} tasks; start it once per job (in the sbatch script or the salloc shell): "
                          "it runs srun itself.")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        raise LaunchError(f"Slurm job {env['SLURM_JOB_ID']}: SLURM_JOB_NODELIST is not set; cannot tell its nodes.")
    nodes = tuple((hostnames or scontrol_hostnames)(nodelist))
    if env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        tasks = (int(env["SLURM_NTASKS_PER_NODE"]),) * len(nodes)
    else:
        tasks = tuple(expand_counts(env.get("SLURM_TASKS_PER_NODE") or "1", len(nodes), "SLURM_TASKS_PER_NODE"))
    cpus = env.get("SLURM_JOB_CPUS_PER_NODE")
    return Allocation(job_id=env["SLURM_JOB_ID"], nodelist=nodelist, nodes=nodes, tasks_per_node=tasks,
                      gpus_per_node=gpus_per_node(env),
                      cpus_per_node=tuple(expand_counts(cpus, len(nodes), "SLURM_JOB_CPUS_PER_NODE")) if cpus else ())


def scontrol_hostnames(nodelist: str) -> list[str]:
    """`scontrol show hostnames NODELIST`; the pure `expand_nodelist` where scontrol cannot run."""
    try:
        result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                timeout=_SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return expand_nodelist(nodelist)
    names = result.stdout.split()
    return names if result.returncode == 0 and names else expand_nodelist(nodelist)


_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """`gpu[01-03,07],cpu1` -> gpu01 gpu02 gpu03 gpu07 cpu1; `r[1-2]-n[1-2]` -> r1-n1 r1-n2 r2-n1 r2-n2
    (Slurm's hostlist syntax: zero padding is kept, several brackets multiply)."""
    names: list[str] = []
    for item in _split_top_level(nodelist):
        pieces = _BRACKETS.split(item)  # text, ranges, text, ranges, ..., text
        if any(bracket in text for text in pieces[0::2] for bracket in "[]"):
            raise LaunchError(f"cannot read the Slurm nodelist {nodelist!r} at {item!r}.")
        choices = [[piece] if index % 2 == 0 else _numbers(piece, nodelist) for index, piece in enumerate(pieces)]
        names += ["".join(combination) for combination in itertools.product(*choices)]
    return names


def _numbers(ranges: str, nodelist: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07."""
    numbers = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise LaunchError(f"cannot read the Slurm nodelist {nodelist!r} at {part!r}.")
        numbers += [f"{number:0{len(low)}d}" for number in range(int(low), int(high or low) + 1)]
    return numbers


def _split_top_level(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(nodelist):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            items.append(nodelist[start:index])
            start = index + 1
    items.append(nodelist[start:])
    return [item.strip() for item in items if item.strip()]


_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_counts(text: str, nodes: int, name: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: Slurm's per-node counts (SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE)."""
    counts: list[int] = []
    for item in text.split(","):
        match = _COUNT.fullmatch(item.strip())
        if match is None:
            raise LaunchError(f"{name}={text}: expected counts like 2(x3),1.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != nodes:
        raise LaunchError(f"{name}={text} gives {len(counts)} node(s), the allocation has {nodes}.")
    return counts


def gpus_per_node(env: Mapping[str, str]) -> int:
    """GPUs the job has on each node: SLURM_GPUS_PER_NODE ([type:]N), else SLURM_GPUS_ON_NODE, else the
    devices listed in SLURM_JOB_GPUS; 0 without GPUs."""
    per_node = env.get("SLURM_GPUS_PER_NODE", "").rpartition(":")[2]
    if per_node.isdigit():
        return int(per_node)
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    return len([device for device in env.get("SLURM_JOB_GPUS", "").split(",") if device.strip()])


def procs_per_node(allocation: Allocation, requested: int | None) -> int:
    """Workers per node: `requested` (recipe or flag), else GPUs per node, else tasks per node."""
    if requested:
        return requested
    if allocation.gpus_per_node:
        return allocation.gpus_per_node
    counts = sorted(set(allocation.tasks_per_node))
    if len(counts) != 1:
        raise LaunchError(f"Slurm job {allocation.job_id} has uneven tasks per node ({', '.join(map(str, counts))}) "
                          "and every node runs the same torchrun: set nproc_per_node in the recipe (or --num-gpus).")
    return counts[0]


# ---------------------------------------------------------------------------------------------
# The plan (pure)


def srun_argv(allocation: Allocation, job_id: str, nodes: Sequence[str] | None = None) -> tuple[str, ...]:
    """srun for one task per node on every allocated node (or on `nodes` of them, after a restart
    dropped the others); a failing task ends the step."""
    count = len(nodes if nodes is not None else allocation.nodes)
    subset = (f"--nodelist={','.join(nodes)}",) if nodes is not None else ()
    return ("srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", *subset, "--kill-on-bad-exit=1",
            f"--job-name={job_id}")


def plan_step(recipe: Recipe, allocation: Allocation, nproc: int, job_id: str, master_port: int,
              facts: MachineFacts, hosts: Sequence[str] | None = None) -> LaunchPlan:
    """The plan of a job as one srun step: `plan.plan` for the allocated nodes (or `hosts` of them), its
    node 0 command made generic (node rank from SLURM_NODEID) and wrapped in srun and the node entry."""
    nodes = [Node(host, tuple(range(nproc))) for host in (hosts if hosts is not None else allocation.nodes)]
    per_node = plan(recipe, nodes, job_id, master_port, facts)
    torchrun = torchrun_argv(facts.python, len(nodes), NODE_RANK, nproc, per_node.master_addr, master_port,
                             recipe.script, recipe.args)
    nvme = [arg for key, path in per_node.nvme_paths.items() for arg in ("--nvme", f"{key}={path}")]
    argv = (*srun_argv(allocation, job_id, hosts), facts.python, "-m", NODE_MODULE,
            "--kill-grace-s", f"{recipe.launch.kill_grace_s:g}", "--run-name", per_node.name,
            "--ranks-per-node", str(nproc), *nvme, "--", *torchrun)
    env = {key: value for key, value in per_node.nodes[0].env.items() if key != NODE_HOST_ENV}
    step_nodes = tuple(node.host for node in nodes)
    step = NodeCommand(allocation.nodelist if hosts is None else ",".join(hosts), 0, 0, per_node.world_size, argv,
                       env, cwd=facts.cwd, step_nodes=step_nodes)
    inputs = dataclasses.replace(per_node.inputs, allocation=allocation)
    return dataclasses.replace(per_node, nodes=(step,), inputs=inputs)


def default_port(allocation: Allocation) -> int:
    """A rendezvous port when the first node is not this machine (so no free port can be picked
    here): the same for every launch in one job, different between jobs sharing a node."""
    return 20000 + int(allocation.job_id) % 10000 if allocation.job_id.isdigit() else 29500


def runs_here(allocation: Allocation, env: Mapping[str, str]) -> bool:
    """Whether this process is on the allocation's first node (the batch script is; salloc's shell may not be)."""
    first = allocation.nodes[0]
    here = {env.get("SLURMD_NODENAME"), socket.gethostname(), socket.gethostname().split(".")[0], "localhost"}
    return first in here


# ---------------------------------------------------------------------------------------------
# Launcher side: the step as a transport


class SlurmTransport(Transport):
    """The srun step: one process here, torchrun on every allocated node."""

    what = "srun"

    def __init__(self, host: str, job_id: str) -> None:
        super().__init__(host, job_id)
        self._proc: subprocess.Popen[bytes] | None = None
        self._slurm_job_id = ""

    def start(self, node: NodeCommand) -> tuple[IO[bytes], IO[bytes]]:
        env = recipe_in_parts({**os.environ, **node.env})
        self._slurm_job_id = env.get("SLURM_JOB_ID", "")
        try:
            self._proc = subprocess.Popen(
                node.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C reaches the launcher only: srun would answer it with SIGKILL
                preexec_fn=functools.partial(die_with_parent, LAUNCHER_GONE))
        except OSError as exc:
            if exc.errno == errno.E2BIG:
                raise LaunchError(f"cannot start srun: its environment ({_env_bytes(env) >> 10} KiB) is over this "
                                  "system's limit for a command; unset large variables before launching.") from None
            raise LaunchError(f"cannot start srun: {exc.strerror or exc}; zerorun launches Slurm jobs with "
                              "Slurm's client commands, which must be on PATH.") from None
        assert self._proc.stdout is not None and self._proc.stderr is not None
        return self._proc.stdout, self._proc.stderr

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def stop(self, grace_s: float) -> int:
        """SIGTERM to every process of the step (each node entry cleans its node up), then harder."""
        if self._proc is None or self._proc.poll() is not None:
            return 0
        step = self._step_id()
        if step is None:
            self._proc.terminate()  # no step yet: srun's own teardown (SIGKILL) is all there is
        else:
            _scancel("--signal=TERM", step)
        try:
            self._proc.wait(timeout=grace_s + 2 * KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            if step is not None:
                _scancel(step)
            try:
                self._proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # slurmstepd notices srun is gone and ends the step
                self._proc.wait()
        return 1

    def _step_id(self) -> str | None:
        """`JOB.STEP` of our step, found by its name (the zerorun job id) while srun runs."""
        deadline = time.monotonic() + _STEP_LOOKUP_S
        while self._slurm_job_id and self.poll() is None:
            try:
                result = subprocess.run(["squeue", "-h", "-s", "-j", self._slurm_job_id, "-o", "%i %j"],
                                        capture_output=True, text=True, timeout=_SLURM_TIMEOUT_S)
                for line in result.stdout.splitlines():
                    step, _, name = line.strip().partition(" ")
                    if name == self.job_id:
                        return step
            except (OSError, subprocess.TimeoutExpired):
                return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        return None


def recipe_in_parts(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the recipe's JSON cut into RECIPE_PART_ENV variables of at most 64 KiB each."""
    parted = {key: value for key, value in env.items() if not key.startswith(RECIPE_PART_ENV)}
    recipe = parted.pop(RECIPE_ENV, None)
    if recipe is not None:
        for index, start in enumerate(range(0, len(recipe), _RECIPE_PART_CHARS)):
            parted[f"{RECIPE_PART_ENV}{index}"] = recipe[start:start + _RECIPE_PART_CHARS]
    return parted


def take_recipe(env: MutableMapping[str, str]) -> str | None:
    """The recipe's JSON joined from its parts, which leave `env` (the workers must not inherit them);
    None when there are none."""
    keys = [key for key in env if key.startswith(RECIPE_PART_ENV)]
    indices = sorted(int(key.removeprefix(RECIPE_PART_ENV)) for key in keys
                     if key.removeprefix(RECIPE_PART_ENV).isdigit())
    if indices != list(range(len(keys))):
        raise LaunchError(f"the recipe reached this node in parts {', '.join(sorted(keys))}: not one run "
                          f"of {RECIPE_PART_ENV}0, 1, ... (is an old {RECIPE_PART_ENV}* variable set?).")
    return "".join(env.pop(f"{RECIPE_PART_ENV}{index}") for index in indices) if indices else None


def _env_bytes(env: Mapping[str, str]) -> int:
    return sum(len(key) + len(value) + 2 for key, value in env.items())


def _scancel(*args: str) -> None:
    try:
        subprocess.run(["scancel", *args], capture_output=True, timeout=_SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        pass


# ---------------------------------------------------------------------------------------------
# Node side: `python -m zerorun.launch.slurm --kill-grace-s G -- TORCHRUN...` in every task of the step


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerorun.launch.slurm",
                                     description="zerorun's node entry in a Slurm step (srun starts it).")
    parser.add_argument("--kill-grace-s", type=float, default=3.0)
    parser.add_argument("--run-name", default="job")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--nvme", action="append", default=[], metavar="KEY=PATH",
                        help="an NVMe offload directory: checked before torchrun starts, cleaned when it ends")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    nvme = dict(item.partition("=")[::2] for item in args.nvme)
    sys.exit(run_on_node(command, args.kill_grace_s, os.environ, StepShape(args.run_name, args.ranks_per_node, nvme)))


@dataclass(frozen=True)
class StepShape:
    """What every node entry of a step shares: the run name, ranks per node, NVMe offload paths."""

    run_name: str
    ranks_per_node: int
    nvme_paths: Mapping[str, str]  # recipe key -> directory


def run_on_node(command: Sequence[str], grace_s: float, env: MutableMapping[str, str], shape: StepShape) -> int:
    """Fill this node's rank and host into the step's command, check its NVMe paths, and run it until
    it ends or a signal comes. `env` is this process's environment: the recipe's parts leave it for
    the job's own environment, where the node supervisor turns the recipe into a file."""
    job_id, node_rank = env.get(JOB_ID_ENV), env.get("SLURM_NODEID")
    if not job_id or node_rank is None or not command:
        print(f"{NODE_MODULE}: {JOB_ID_ENV}, SLURM_NODEID and a command are needed (zerorun launch inside a "
              "Slurm allocation starts this module with srun).", file=sys.stderr)
        return 2
    host = env.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        recipe = take_recipe(env)
    except LaunchError as exc:
        print(f"{NODE_MODULE}: host {host}: {exc}", file=sys.stderr)
        return 2
    problems = [p for p in (offload_files.inspect_path(path, key) for key, path in shape.nvme_paths.items()) if p]
    if problems:
        print(f"{NODE_MODULE}: host {host}: {'; '.join(problems)}", file=sys.stderr)
        return 2
    argv = tuple(node_rank if arg == NODE_RANK else arg for arg in command)
    first = int(node_rank) * shape.ranks_per_node
    ranks = range(first, first + shape.ranks_per_node)
    dirs = tuple(str(offload_files.rank_dir(path, job_id, r))
                 for path in sorted(set(shape.nvme_paths.values())) for r in ranks)
    job_env = {NODE_HOST_ENV: host, **({RECIPE_ENV: recipe} if recipe is not None else {})}
    job = NodeJob(argv, job_env, os.getcwd(), grace_s, offload_dirs=dirs)
    order = StopOrder()
    order.on_signals(signal.SIGTERM, signal.SIGINT, signal.SIGHUP, LAUNCHER_GONE)
    return run_node(job, job_id, host, order)


if __name__ == "__main__":
    main()
