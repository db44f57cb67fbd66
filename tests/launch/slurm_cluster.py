"""A private one-node Slurm cluster for the Slurm launch tests: munged, slurmctld and slurmd from a temp dir.

    cluster = PrivateSlurm.start(directory)
    cluster.env()              # os.environ plus SLURM_CONF=<directory>/slurm.conf: for salloc, sbatch, ...
    cluster.stop()             # cancels every job, ends the daemons and whatever slurmstepd they left

Everything lives in `directory`: the munge key, socket and logs, a generated slurm.conf (its own
cluster name, free ports, state, spool and pid files), and the daemons' logs. The node is
`localhost` with this machine's CPUs; the daemons run in the foreground as children of the test
process (with a parent-death signal), so a crashed test run does not leave them behind either.
Nothing touches /etc/slurm or /etc/munge. See the "Slurm on one host" field notes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import psutil

from zerorun.launch.processes import die_with_parent

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "scontrol", "scancel", "squeue", "sinfo")
_START_TIMEOUT_S = 30.0
_SBIN = ("/usr/sbin", "/usr/local/sbin")


def find(program: str) -> str | None:
    return shutil.which(program) or next((f"{d}/{program}" for d in _SBIN if os.access(f"{d}/{program}", os.X_OK)),
                                         None)


def missing_programs() -> list[str]:
    """The Slurm and munge programs this fixture needs that are not installed."""
    return [program for program in (*DAEMONS, *CLIENTS) if find(program) is None]


class PrivateSlurm:
    def __init__(self, directory: Path, cpus: int) -> None:
        self.directory = directory
        self.cpus = cpus
        self.conf = directory / "slurm.conf"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started_s = 0.0  # how long start() took

    @classmethod
    def start(cls, directory: Path, cpus: int | None = None) -> PrivateSlurm:
        """Start the cluster and wait until its node takes jobs; raise RuntimeError (after cleaning up) if not."""
        started = time.monotonic()
        cluster = cls(directory, cpus or os.cpu_count() or 1)
        try:
            cluster._start_munged()
            cluster._write_conf()
            cluster._spawn("slurmctld", [find("slurmctld"), "-D", "-i", "-f", str(cluster.conf)])
            cluster._spawn("slurmd", [find("slurmd"), "-D", "-N", "localhost", "-f", str(cluster.conf)])
            cluster._wait_until_idle()
        except BaseException:
            cluster.stop()
            raise
        cluster.started_s = time.monotonic() - started
        return cluster

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this environment) with SLURM_CONF set and no allocation inherited from an outer job."""
        env = {key: value for key, value in (base or os.environ).items() if not key.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def job_state(self, job_id: str) -> str | None:
        """The job's state (RUNNING, COMPLETED, FAILED, ...) while slurmctld still remembers it."""
        result = self.run("scontrol", "-o", "show", "job", job_id)
        for field in result.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return None

    def stop(self) -> None:
        """Cancel every job, end the daemons, and kill any slurmstepd they left behind."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--full", "--user", str(os.getuid()), timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for proc in self.leftovers():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def leftovers(self) -> list[psutil.Process]:
        """Live processes started for this cluster: the daemons and every slurmstepd (they carry SLURM_CONF)."""
        found = []
        for proc in psutil.process_iter(["environ"], ad_value=None):
            env = proc.info.get("environ") or {}
            if proc.pid == os.getpid():
                continue
            if env.get("SLURM_CONF") == str(self.conf):
                try:
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        found.append(proc)
                except psutil.NoSuchProcess:
                    pass
        return found

    # -- starting ---------------------------------------------------------------------------------

    def _start_munged(self) -> None:
        munge = self.directory / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn("munged", [find("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.munge_socket}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait_for(lambda: os.path.exists(self.munge_socket), "munged's socket")

    @property
    def munge_socket(self) -> str:
        return str(self.directory / "munge" / "munge.socket")

    def _write_conf(self) -> None:
        d = self.directory
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir()
        ctld_port, slurmd_port = _free_ports(2)
        user = "root" if os.geteuid() == 0 else psutil.Process().username()
        self.conf.write_text("\n".join([
            f"ClusterName=zr{os.getpid()}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=2",  # SIGTERM to SIGKILL when a step is cancelled: keeps the tests fast
            "MinJobAge=300",  # finished jobs stay visible to `scontrol show job` for the tests
            "InactiveLimit=0",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"NodeName=localhost CPUs={self.cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _spawn(self, name: str, argv: list[str | None]) -> None:
        assert all(argv), f"{name} is not installed"
        log = open(self.directory / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen([str(a) for a in argv], env=self.env(), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=die_with_parent)
        log.close()

    def _wait_until_idle(self) -> None:
        def idle() -> bool:
            result = self.run("sinfo", "-h", "-N", "-o", "%T", timeout=10)
            return result.returncode == 0 and result.stdout.strip().rstrip("*") == "idle"

        self._wait_for(idle, "the node to be idle")

    def _wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not condition():
            dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"private Slurm cluster: no {what} within {_START_TIMEOUT_S:g} s"
                                   f"{' (' + ', '.join(dead) + ' exited)' if dead else ''}:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        """The tail of every daemon's log, for failure messages."""
        parts = []
        for path in sorted([*self.directory.glob("*.out"), *self.directory.glob("log/*.log"),
                            *self.directory.glob("munge/*.log")]):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()

