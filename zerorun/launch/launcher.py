"""`zerorun launch`: from a recipe file and the command-line options to a finished job.

    launch_plan = make_plan("recipe.yaml", LaunchOptions(hostfile="hosts"))   # reads, decides nothing runs
    print(render(launch_plan))                                                # --dry-run
    exit_code = run(launch_plan)                                              # starts, supervises, tears down

`make_plan` gathers the impure facts (recipe file, hostfile, GPU count, CPU count, a free port, the job
id, the working directory and its `.zerorun_env`) and hands them to the pure `plan.plan`; inside a
Slurm allocation (unless a hostfile or `--launcher` says otherwise) the allocation's nodes go to
`slurm.plan_step` instead, which plans one srun step for them all. `run`
takes the job's directories (`ownership`: a second job on the same run name or checkpoint.dir is
refused), checks every node (`preflight`: SSH hosts, NVMe paths), picks a transport per node, starts the telemetry
monitor (collector, live view, stall watch) unless the recipe turned it off, tells the workers its
address, and lets the supervisor drive the job.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import secrets
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from zerorun import config
from zerorun.config import Recipe
from zerorun.errors import HostfileError, LaunchError
from zerorun.launch import capacity, hostfile, ownership, preflight, recovery, slurm
from zerorun.launch.devices import gpu_count
from zerorun.launch.hostfile import Node
from zerorun.launch.plan import LaunchPlan, MachineFacts, NodeCommand, is_local, plan, render, with_env
from zerorun.launch.ssh import SSHTransport
from zerorun.launch.supervisor import Ending, Outcome, Supervisor
from zerorun.launch.transport import LocalTransport, Transport
from zerorun.telemetry import ADDRESS_ENV, RUNS_DIR, TOKEN_ENV, profile_files

if TYPE_CHECKING:
    from zerorun.launch.monitor import Monitor

__all__ = ["LaunchOptions", "Reach", "make_plan", "render", "run"]


@dataclass(frozen=True)
class LaunchOptions:
    """The options of `zerorun launch` (the CLI maps its flags onto these one to one)."""

    hostfile: str | None = None  # overrides the recipe's `hostfile`
    include: str | None = None  # DeepSpeed-style NAME[:SLOT,...]@... to keep
    exclude: str | None = None  # ... or to drop
    num_nodes: int | None = None  # the first N hosts
    num_gpus: int | None = None  # the first N slots of every host (default: the recipe's nproc_per_node)
    master_addr: str | None = None  # overrides the recipe's `master_addr`
    master_port: int | None = None  # overrides the recipe's `master_port`
    overrides: Sequence[str] = field(default_factory=tuple)  # `--set KEY=VALUE`
    launcher: str | None = None  # local, ssh or slurm: overrides the recipe's `launch.transport`
    max_restarts: int | None = None  # overrides the recipe's `launch.max_restarts`


class Reach(Protocol):
    """How the launcher reaches the nodes of each attempt, and what its telemetry tells the workers."""

    telemetry_token: str | None  # the collector's token (None: a random one per job)
    telemetry_host: str | None  # the address workers reach the collector by (None: this host's name)

    def transports(self, launch_plan: LaunchPlan) -> list[Transport]:
        """One transport per node of the plan, in order."""


class _Direct:
    """The launcher starts every node itself: a local process, ssh, or an srun step."""

    telemetry_token: str | None = None
    telemetry_host: str | None = None

    def transports(self, launch_plan: LaunchPlan) -> list[Transport]:
        return [transport_for(node, launch_plan) for node in launch_plan.nodes]


def make_plan(recipe_path: str | os.PathLike, options: LaunchOptions) -> LaunchPlan:
    """Load the recipe, select the nodes and plan the job; starts nothing."""
    flags = [f"master_addr={options.master_addr}"] if options.master_addr else []
    flags += [f"master_port={options.master_port}"] if options.master_port else []
    flags += [f"launch.transport={options.launcher}"] if options.launcher else []
    flags += [f"launch.max_restarts={options.max_restarts}"] if options.max_restarts is not None else []
    recipe = config.load(recipe_path, overrides=[*options.overrides, *flags])
    if uses_slurm(recipe, options, os.environ):
        return _slurm_plan(recipe, options)
    gpus = gpu_count()
    nodes = select_nodes(recipe, options, gpus)
    facts = machine_facts(os.cpu_count() or 1)
    master_port = recipe.master_port or (free_port() if is_local(nodes[0].host) else 29500)
    launch_plan = plan(recipe, nodes, new_job_id(recipe.name or "job"), master_port, facts)
    capacity.check(launch_plan.nodes, capacity.this_machine(gpus), recipe.launch.oversubscribe,
                   workers_origin(recipe, options))
    return launch_plan


def workers_origin(recipe: Recipe, options: LaunchOptions) -> str:
    """What asked for this machine's workers, as a message names it: the flag, the key (file:line), or the default."""
    if options.num_gpus is not None:
        return f"--num-gpus {options.num_gpus}"
    if options.hostfile or recipe.hostfile:
        return f"the hostfile {options.hostfile or recipe.hostfile} (its slots for this machine)"
    if recipe.nproc_per_node is not None:
        where = recipe.given.get("nproc_per_node", recipe.source or "the recipe")
        return f"{where}: nproc_per_node: {recipe.nproc_per_node}"
    return "the default nproc_per_node (2 workers on a machine without GPUs)"


def uses_slurm(recipe: Recipe, options: LaunchOptions, env: Mapping[str, str]) -> bool:
    """Whether the job runs as an srun step: `launch.transport: slurm` (or `--launcher slurm`), or
    `auto` inside an allocation when no hostfile names the hosts."""
    hostfile_given = bool(options.hostfile or recipe.hostfile)
    if recipe.launch.transport == "auto":
        return slurm.in_allocation(env) and not hostfile_given
    if recipe.launch.transport != "slurm":
        return False
    origin = "--launcher slurm" if options.launcher else f"{recipe.source or 'the recipe'}: launch.transport: slurm"
    if not slurm.in_allocation(env):
        raise LaunchError(f"{origin}: not inside a Slurm allocation (SLURM_JOB_ID is not set); run it inside "
                          "`salloc` or an sbatch script, or submit the job with `zerorun submit`.")
    if hostfile_given:
        raise LaunchError(f"{origin}: the nodes are the Slurm allocation's; drop the hostfile "
                          "(--hostfile, or `hostfile:` in the recipe), or use --launcher ssh.")
    return True


def _slurm_plan(recipe: Recipe, options: LaunchOptions) -> LaunchPlan:
    """One srun step on every node of the allocation this launcher runs in."""
    if options.include or options.exclude or options.num_nodes:
        raise LaunchError("--include, --exclude and --num-nodes choose hosts of a hostfile; inside a Slurm "
                          "allocation every allocated node runs (ask salloc/sbatch for fewer nodes).")
    allocation = slurm.read_allocation(os.environ)
    nproc = slurm.procs_per_node(allocation, options.num_gpus or recipe.nproc_per_node)
    facts = machine_facts(min(allocation.cpus_per_node, default=os.cpu_count() or 1))
    here = slurm.runs_here(allocation, os.environ)
    master_port = recipe.master_port or (free_port() if here else slurm.default_port(allocation))
    return slurm.plan_step(recipe, allocation, nproc, new_job_id(recipe.name or "job"), master_port, facts)


def machine_facts(cpu_count: int) -> MachineFacts:
    """This machine's facts, as `plan()` takes them."""
    cwd = os.getcwd()
    return MachineFacts(cpu_count=cpu_count, python=sys.executable, inherited_env=dict(os.environ),
                        cwd=cwd, env_file=load_env_file(cwd), hostname=socket.getfqdn())


def run(launch_plan: LaunchPlan, reach: Reach | None = None) -> int:
    """Run the planned job to its end, restarting it after failures as `launch.max_restarts` allows;
    return the launcher's exit code (the last attempt's). `reach`: how the nodes are reached (default:
    the launcher starts each itself)."""
    if importlib.util.find_spec("torch") is None:
        raise LaunchError(f"torch is not installed for {sys.executable}; zerorun runs workers with torchrun.")
    claim = ownership.claim_paths(launch_plan)  # runs/<name>/ and checkpoint.dir are this job's until it ends
    try:
        for note in claim.notes:
            _say(f"warning: {note}")
        preflight.check(launch_plan)
        return _run_attempts(launch_plan, reach or _Direct())
    finally:
        claim.release()


def _run_attempts(launch_plan: LaunchPlan, reach: Reach) -> int:
    monitor = _start_monitor(launch_plan, reach)
    policy = _policy(launch_plan)
    base_job_id = launch_plan.job_id  # attempt k runs as <base>-r<k>: its processes apart from the last one's
    failures: list[recovery.Failure] = []
    exit_code = 1
    profile = launch_plan.telemetry
    if profile.profile_start is not None:
        _say(profile_files.planned(launch_plan.name, base_job_id, profile.profile_start, profile.profile_steps))
    try:
        while True:
            outcome = _attempt(launch_plan, monitor, reach)
            torn_down_at = time.time()
            exit_code = outcome.exit_code
            if outcome.ending is Ending.SUCCESS or not policy.max_restarts:
                return exit_code
            failures.append(_failure(outcome, monitor))
            following = _next_attempt(launch_plan, base_job_id, policy, failures)
            if following is None:
                return exit_code
            launch_plan, decision = following
            if monitor is not None:
                monitor.restarted(launch_plan, len(failures), outcome.cause, decision, outcome.detected_at,
                                  torn_down_at)
    finally:
        if monitor is not None:
            monitor.finish(exit_code)
        if profile.profile_start is not None:
            _say_profiles(launch_plan.name, base_job_id)


def _say_profiles(name: str, job_id: str) -> None:
    """Where the ranks' profiles went (those of this machine; other nodes keep theirs at the same path)."""
    files = profile_files.written_under(Path(RUNS_DIR) / name, job_id)
    _say(profile_files.describe(files) or f"profile: no trace in {Path(RUNS_DIR) / name / 'profile'}/ on this "
         "machine (the job ended before the window, or the ranks warned why)")


def _attempt(launch_plan: LaunchPlan, monitor: Monitor | None, reach: Reach) -> Outcome:
    """One run of the plan on its nodes, from start to teardown."""
    transports = reach.transports(launch_plan)
    if is_local(launch_plan.nodes[0].host):
        _check_port_free(launch_plan.master_addr, launch_plan.master_port)
    if monitor is not None:
        launch_plan = with_env(launch_plan, {ADDRESS_ENV: monitor.address, TOKEN_ENV: monitor.token})
    failure_log = Path(RUNS_DIR) / launch_plan.name / f"failure-{launch_plan.job_id}.log"  # runs/<name>/: this job's
    supervisor = Supervisor(launch_plan, transports, output=monitor, witness=monitor, failure_log=failure_log)
    supervisor.run()
    assert supervisor.outcome is not None
    return supervisor.outcome


def _policy(launch_plan: LaunchPlan) -> recovery.Policy:
    assert launch_plan.inputs is not None, "run: a plan from make_plan knows its recipe"
    recipe = launch_plan.inputs.recipe
    launch = recipe.launch
    for warning in recovery.policy_warnings(launch.max_restarts, launch.on_node_failure, recipe.checkpoint.dir,
                                            recipe.checkpoint.resume):
        _say(f"warning: {warning}")
    return recovery.Policy(launch.max_restarts, launch.on_node_failure, launch.min_nodes)


def _failure(outcome: Outcome, monitor: Monitor | None) -> recovery.Failure:
    step = monitor.last_step() if monitor is not None else None
    return recovery.Failure(outcome.ending, outcome.cause, outcome.exit_code, outcome.host, outcome.rank, step)


def _next_attempt(launch_plan: LaunchPlan, base_job_id: str, policy: recovery.Policy,
                  failures: list[recovery.Failure]) -> tuple[LaunchPlan, str] | None:
    """The plan of the next attempt, preflight passed, and the decision in words; None when the job
    stops (and why is said)."""
    inputs = launch_plan.inputs
    assert inputs is not None
    recipe = inputs.recipe
    batch = recovery.Batch(recipe.train.micro_batch_size, recipe.train.grad_accum_steps)
    unreachable: list[str] = []
    while True:
        decision = recovery.decide(policy, failures, inputs.nodes, batch, unreachable)
        _say(decision.reason)
        if not decision.restart:
            return None
        assert decision.batch is not None
        attempt = len(failures)
        next_plan = replan(launch_plan, decision.nodes, decision.batch, f"{base_job_id}-r{attempt}")
        failed = preflight.failed_hosts(next_plan)
        if not failed:
            break
        if policy.on_node_failure != "shrink":
            raise LaunchError(f"restart {attempt}: preflight failed; nothing was started: "
                              + "; ".join(f"{host}: {problem}" for host, problem in failed.items()))
        unreachable = sorted(set(unreachable) | set(failed))  # decide again without them
    _say(resume_point(recipe, failures[-1]))
    return next_plan, decision.reason


def replan(launch_plan: LaunchPlan, nodes: Sequence[Node], batch: recovery.Batch, job_id: str) -> LaunchPlan:
    """The same job planned again on `nodes` with `batch` (a restart), under `job_id`."""
    inputs = launch_plan.inputs
    assert inputs is not None
    train = dataclasses.replace(inputs.recipe.train, micro_batch_size=batch.micro_batch_size,
                                grad_accum_steps=batch.grad_accum_steps)
    recipe = dataclasses.replace(inputs.recipe, train=train)
    port = recipe.master_port or (free_port() if is_local(nodes[0].host) else launch_plan.master_port)
    if inputs.allocation is not None:
        nproc = inputs.nodes[0].nproc
        return slurm.plan_step(recipe, inputs.allocation, nproc, job_id, port, inputs.facts,
                               [node.host for node in nodes])
    return plan(recipe, nodes, job_id, port, inputs.facts, joined=inputs.joined)


def resume_point(recipe: Recipe, failure: recovery.Failure) -> str:
    """Where the next attempt resumes: the checkpoint `latest` names (the engine's auto-resume loads it)."""
    reached = f"; telemetry last saw step {failure.step}" if failure.step is not None else ""
    directory = recipe.checkpoint.dir
    tag = _latest_tag(directory) if directory and recipe.checkpoint.resume == "auto" else None
    if tag is None:
        return f"no checkpoint to resume from: the job starts again from step 0 with the same seed{reached}"
    step = tag.rpartition("-")[2]
    if failure.step is not None and step.isdigit() and failure.step <= int(step):
        # telemetry arrives a moment after the step (and not at all from a rank killed first): it lags
        reached = f"; telemetry last saw step {failure.step}, so it cannot say how far past step {step} the job got"
    elif failure.step is None:  # steps faster than the telemetry interval: the failure came before any report
        reached = f"; telemetry saw no step, so it cannot say how far past step {step} the job got"
    lost = f"; steps {int(step) + 1}-{failure.step} run again" if failure.step and step.isdigit() and \
        failure.step > int(step) else ""
    return f"resuming from checkpoint {tag} in {directory}{reached}{lost}"


def _latest_tag(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "latest")) as file:
            return file.read().strip() or None
    except OSError:
        return None


def _say(message: str) -> None:
    print(f"zerorun: {message}", file=sys.stderr, flush=True)


def _start_monitor(launch_plan: LaunchPlan, reach: Reach) -> Monitor | None:
    """The telemetry monitor, listening; None when the recipe turned telemetry off or it cannot start."""
    if not launch_plan.telemetry.enabled:
        return None
    from zerorun.launch.monitor import Monitor

    monitor = Monitor(launch_plan, token=reach.telemetry_token, advertise=reach.telemetry_host)
    try:
        monitor.start()
    except OSError as exc:  # the job runs without telemetry rather than not at all
        print(f"zerorun: telemetry off: cannot start the collector ({monitor.path}): {exc}", file=sys.stderr)
        return None
    return monitor


def transport_for(node: NodeCommand, launch_plan: LaunchPlan) -> Transport:
    """The transport that reaches `node`'s host: an srun step, SSH when the plan says so, else a local process."""
    if node.step_nodes:
        return slurm.SlurmTransport(node.host, launch_plan.job_id)
    if node.over_ssh:
        return SSHTransport(node.host, launch_plan.job_id, launch_plan.ssh, launch_plan.kill_grace_s)
    return LocalTransport(node.host, launch_plan.job_id, node.argv[0], launch_plan.kill_grace_s)


def select_nodes(recipe: Recipe, options: LaunchOptions, gpus: int) -> list[Node]:
    """The nodes from the hostfile (flag, else recipe) narrowed by the options, or the local machine.

    The recipe's `nproc_per_node` acts as `--num-gpus` on hostfile nodes unless the command line
    chose slots itself (`--num-gpus`, `--include`, `--exclude`): explicit flags win over the recipe.
    """
    path = options.hostfile or recipe.hostfile
    if path is None:
        if options.include or options.exclude or (options.num_nodes or 1) > 1:
            raise HostfileError("--include, --exclude and --num-nodes choose hosts from a hostfile; "
                                "give one with --hostfile (or `hostfile:` in the recipe).")
        return [hostfile.local_node(options.num_gpus or recipe.nproc_per_node or gpus or 2)]
    hosts = hostfile.parse_hostfile(path)
    slots_chosen = options.num_gpus is not None or options.include or options.exclude
    if slots_chosen or recipe.nproc_per_node is None:
        return hostfile.select_nodes(hosts, options.include, options.exclude, options.num_nodes, options.num_gpus)
    try:
        return hostfile.select_nodes(hosts, None, None, options.num_nodes, recipe.nproc_per_node)
    except HostfileError as exc:
        raise HostfileError(f"{recipe.source}: nproc_per_node: {recipe.nproc_per_node} applies as --num-gpus "
                            f"to hostfile nodes: {exc}") from None


ENV_FILE = ".zerorun_env"


def load_env_file(cwd: str) -> dict[str, str]:
    """The variables of `.zerorun_env` in `cwd`, else in the home directory (none if neither exists)."""
    for directory in (cwd, os.path.expanduser("~")):
        path = os.path.join(directory, ENV_FILE)
        try:
            with open(path) as file:
                return parse_env_file(file.read(), path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise LaunchError(f"{path}: cannot read ({exc.strerror or exc}).") from None
    return {}


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """`KEY=VALUE` lines; blank lines and `#` comments are skipped, a value may be quoted."""
    env: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier():
            raise LaunchError(f"{source}:{number}: expected KEY=VALUE, got {raw.strip()!r}.")
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def new_job_id(name: str) -> str:
    """`<name>-<YYYYmmdd-HHMMSS>-<8 hex>`: readable, and unique enough to find the job's processes by."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
    return f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def free_port() -> int:
    """A TCP port free on this machine right now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_port_free(addr: str, port: int) -> None:
    """A taken master port fails here with a clear message instead of deep inside torchrun."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                raise LaunchError(f"master_addr {addr} is not an address of this machine; a local launch "
                                  "needs a local master_addr (or leave it unset).") from None
            raise LaunchError(f"master port {port} on {addr} is not available ({exc.strerror or exc}); "
                              "pick another with `--set master_port=N`, or leave master_port unset for a free one.") from None
