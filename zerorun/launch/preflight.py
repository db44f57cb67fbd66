"""Preflight: before anything starts, check every node the way it will run.

- **SSH hosts.** One `ssh host` per host, at most `SSH_CONCURRENCY` at once, runs the node's Python in the job's working
  directory with the propagated PATH/PYTHONPATH/virtualenv, and reports its Python, torch and
  zerorun versions, whether the training script is there, and what is wrong with each NVMe
  offload path there. The launcher compares them with its own and prints one table; any
  difference (or an unreachable host) stops the launch with that table and what to do. Versions
  must match because every rank runs the same collectives on the same flat layouts: a different
  torch or zerorun on one host fails late and obscurely.
- **NVMe offload paths** (`zero.offload_*.nvme_path`) on every node: the directory exists, is
  writable, is on a real disk and takes O_DIRECT I/O (`offload_files.inspect_path`). Local nodes
  are checked here, SSH hosts by the probe above, Slurm nodes by their node entry before torchrun
  starts. How much space the files need depends on the model, which only the workers know: they
  check it per node, for all its ranks together, before any rank preallocates (`check_nvme_path`).
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import subprocess
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from zerorun import offload_files
from zerorun.errors import LaunchError
from zerorun.launch.plan import LaunchPlan, NodeCommand
from zerorun.launch.ssh import ssh_argv
from zerorun.launch.transport import bootstrap_env

TIMEOUT_S = 30.0
SSH_CONCURRENCY = 32  # ssh probes at once (pdsh's default fan-out): 2,000 hosts are not 2,000 processes at once
def version(module: str) -> str:
    """An installed package's version: from its metadata when there is some (importing torch takes
    seconds), else from the module itself. The probe runs this same function on every host."""
    import importlib.metadata

    try:
        return importlib.metadata.version(module)
    except Exception:  # noqa: BLE001 - not installed as a package (a checkout on PYTHONPATH)
        pass
    try:
        return __import__(module).__version__
    except Exception as exc:  # noqa: BLE001 - a missing or broken install is what the table reports
        return "missing (" + type(exc).__name__ + ")"


# Run by the remote python: must not need zerorun to be importable (that is one of the checks).
_PROBE = "import json, os, platform, sys\n" + inspect.getsource(version) + """
def nvme(paths):
    try:
        from zerorun.offload_files import inspect_path
    except Exception:
        return []
    return [problem for problem in (inspect_path(path, key) for key, path in paths.items()) if problem]
print(json.dumps({"python": platform.python_version(), "torch": version("torch"), "zerorun": version("zerorun"),
                  "script": os.path.isfile(sys.argv[1]), "nvme": nvme(json.loads(sys.argv[2]))}))
"""


@dataclass(frozen=True)
class HostCheck:
    """What one host reported (or why it could not)."""

    host: str
    python: str = "-"
    torch: str = "-"
    zerorun: str = "-"
    script: bool | None = None  # None: not checked
    problem: str = ""  # empty: reachable and every check passed


def local_facts() -> dict[str, str]:
    """This machine's versions, found as the probe finds them on every host."""
    import platform

    return {"python": platform.python_version(), "torch": version("torch"), "zerorun": version("zerorun")}


def check(launch_plan: LaunchPlan) -> None:
    """Raise a LaunchError if any node of the plan is not ready to run; nothing has started then."""
    check_local_nvme(launch_plan)
    check_hosts(launch_plan)


def failed_hosts(launch_plan: LaunchPlan) -> dict[str, str]:
    """Host -> problem, for every node of the plan that is not ready (a restart drops them under shrink)."""
    try:
        check_local_nvme(launch_plan)
    except LaunchError as exc:
        return {node.host: str(exc) for node in launch_plan.nodes if not node.over_ssh}
    return {check.host: check.problem for check in _host_checks(launch_plan) if check.problem}


def check_local_nvme(launch_plan: LaunchPlan) -> None:
    """The NVMe offload paths of the nodes on this machine."""
    local = [node for node in launch_plan.nodes if not node.over_ssh and not node.step_nodes]
    if not local or not launch_plan.nvme_paths:
        return
    problems = [problem for node in local[:1] for key, path in launch_plan.nvme_paths.items()
                if (problem := offload_files.inspect_path(os.path.join(node.cwd, path), key))]
    if problems:
        raise LaunchError(f"preflight failed on {local[0].host}; nothing was started: {'; '.join(problems)}")


def check_hosts(launch_plan: LaunchPlan) -> None:
    """Raise a LaunchError with the table if any SSH node of the plan is not ready to run."""
    checks = _host_checks(launch_plan)
    failed = [check for check in checks if check.problem]
    if failed:
        script, expected = _script(launch_plan), local_facts()
        raise LaunchError(f"preflight failed on {len(failed)} of {len(checks)} host(s); nothing was started.\n"
                          f"{render(checks, expected, script)}")


def _host_checks(launch_plan: LaunchPlan) -> list[HostCheck]:
    """Every SSH node of the plan, probed `SSH_CONCURRENCY` at a time."""
    remote = [node for node in launch_plan.nodes if node.over_ssh]
    if not remote:
        return []
    script, expected = _script(launch_plan), local_facts()
    with ThreadPoolExecutor(min(len(remote), SSH_CONCURRENCY)) as pool:
        return list(pool.map(lambda node: check_host(launch_plan, node, script, expected, launch_plan.nvme_paths),
                             remote))


def _script(launch_plan: LaunchPlan) -> str:
    argv = launch_plan.nodes[0].argv
    return argv[argv.index("--") + 1]  # torchrun ... -m worker -- SCRIPT ARGS


def check_host(launch_plan: LaunchPlan, node: NodeCommand, script: str, expected: dict[str, str],
               nvme_paths: Mapping[str, str] | None = None) -> HostCheck:
    """Probe one host over SSH and compare what it reports with `expected`; check its NVMe paths."""
    env = [f"{key}={value}" for key, value in bootstrap_env(node).items()]
    command = (f"cd {shlex.quote(node.cwd)} && exec "
               + shlex.join(["env", *env, node.argv[0], "-c", _PROBE, script, json.dumps(dict(nvme_paths or {}))]))
    try:
        result = subprocess.run(ssh_argv(launch_plan.ssh, node.host, command), stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return HostCheck(node.host, problem=f"no answer over ssh within {TIMEOUT_S:g} s")
    except OSError as exc:
        return HostCheck(node.host, problem=f"cannot run ssh: {exc.strerror or exc}")
    last_error = (result.stderr.strip().splitlines() or [""])[-1]
    if result.returncode == 255:
        return HostCheck(node.host, problem=f"unreachable over ssh: {last_error or 'exit code 255'}")
    try:
        facts = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return HostCheck(node.host, problem=f"{node.argv[0]} in {node.cwd} failed (exit code {result.returncode}): "
                                            f"{last_error}")
    problems = [f"{key} {facts[key]} here, {expected[key]} on the launcher"
                for key in ("python", "torch", "zerorun") if facts[key] != expected[key]]
    if not facts["script"]:
        problems.append(f"no script {script}")
    problems += facts.get("nvme") or []
    return HostCheck(node.host, facts["python"], facts["torch"], facts["zerorun"], facts["script"], "; ".join(problems))


def render(checks: list[HostCheck], expected: dict[str, str], script: str) -> str:
    """The preflight table: one row per host, the launcher's own versions first."""
    rows = [("host", "python", "torch", "zerorun", "script", "problem"),
            ("(launcher)", expected["python"], expected["torch"], expected["zerorun"], "yes", "")]
    shown = {True: "yes", False: "no", None: "-"}
    rows += [(c.host, c.python, c.torch, c.zerorun, shown[c.script], c.problem or "ok") for c in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows]
    lines.append(f"Every host needs the launcher's Python, torch and zerorun in the same paths, and {script} "
                 "(a shared filesystem, or the same checkout everywhere); ssh settings come from the recipe's "
                 "`ssh:` section and ~/.ssh/config.")
    return "\n".join(line.rstrip() for line in lines)
