"""The fault table: inject each fault into a real launch and record how the job ends.

    python -m tests.launch.fault_table                 # every case, a markdown table on stdout
    python -m tests.launch.fault_table hang ssh-stop   # some of them

Not a test (it takes minutes and measures times): it is how the closing note's "before / after"
table of issue 15 was made, and a way to re-measure it on a quiet machine. For each case it
reports the seconds from the fault to the launcher's exit, the exit code, what the launcher named
as the cause (its `zerorun: job ... stopped` / failure lines), and what was left: live processes
of the job (by job id and printed pids), NVMe offload files, the job's shared-memory segments in
/dev/shm, and `.zerorun-lock` files under the case's directory that still name a job: held, or
stale (a launcher killed by SIGKILL cannot release its lock; the kernel frees it, the file keeps
its name). A released lock is left in place, empty.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.launch.launched import LaunchedJob, write_recipe

TINY = str(Path(__file__).resolve().parents[1] / "telemetry" / "scripts" / "tiny_train.py")
_CAUSE = re.compile(r"^(zerorun: (job \S+ stopped.*|lost contact.*|.*failed.*|error: .*|warning: .*)|\S*Error: .*|"
                    r"\[\S+\] zerorun: error: .*)$")


@dataclass
class Row:
    case: str
    seconds: float | None
    code: int | None
    cause: str
    leftovers: str


def _pid_of(job: LaunchedJob, host_rank: str) -> int:
    line = next(line for line in job.stdout if line.startswith(f"[{host_rank}] pid "))
    return int(line.rsplit(" ", 1)[1])


def _cause(job: LaunchedJob) -> str:
    lines = [line for line in job.stderr if _CAUSE.match(line) or line.startswith("=" * 20 + " ")]
    shown = [line.strip("= ").removeprefix("zerorun: ") for line in lines]
    return " / ".join(dict.fromkeys(shown))[:300] or "(nothing)"


def _segments(job: LaunchedJob) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if any(name.startswith(f"zerorun-{i}-") for i in job.job_ids)]


def _locks(work: Path) -> tuple[int, int]:
    """`.zerorun-lock` files under `work` that still name a job: (held by a live process, stale: free,
    left by a launcher that could not release it, named and taken over by the next job)."""
    import fcntl

    held = stale = 0
    for lock in work.rglob(".zerorun-lock"):
        if not lock.stat().st_size:
            continue
        with open(lock) as file:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(file, fcntl.LOCK_UN)
                stale += 1
            except BlockingIOError:
                held += 1
    return held, stale


def _files(directory: Path | None) -> list[str]:
    if directory is None or not directory.exists():
        return []
    return [str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()]


def _run(case: str, work: Path, start: Callable[[Path], LaunchedJob], fault: Callable[[LaunchedJob], None],
         nvme: Path | None = None, settle_s: float = 15.0) -> Row:
    job = start(work)
    try:
        fault(job)
        fault_at = time.monotonic()
        try:
            code = job.wait(timeout=180)
        except AssertionError:
            job.cleanup()
            return Row(case, None, None, "never noticed: still running 180 s after the fault", "(killed by the table)")
        seconds = time.monotonic() - fault_at
        deadline = time.monotonic() + settle_s
        while job.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        procs, files, segments, (held, stale) = job.leftovers(), _files(nvme), _segments(job), _locks(work)
        left = ", ".join(filter(None, [f"{len(procs)} processes" if procs else "",
                                       f"{len(files)} NVMe files" if files else "",
                                       f"{len(segments)} /dev/shm segments" if segments else "",
                                       f"{held} held locks" if held else "",
                                       f"{stale} stale lock files (free; the next job names and takes them over)"
                                       if stale else ""])) or "none"
        return Row(case, seconds, code, _cause(job), left)
    finally:
        job.cleanup()


def _wait_steps(job: LaunchedJob, count: int = 2, timeout: float = 120.0) -> None:
    job.wait_until(lambda: sum("pid " in line for line in job.stdout) >= count, "workers up", timeout)
    time.sleep(3.0)  # a few steps


def cases(work_root: Path) -> dict[str, Callable[[], Row]]:
    def local(script: str, args: list[str] = (), **keys: object) -> Callable[[Path], LaunchedJob]:
        def start(work: Path) -> LaunchedJob:
            return LaunchedJob.start(write_recipe(work, script, args, **keys), cwd=work)
        return start

    def fresh(name: str) -> Path:
        path = work_root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    slow = {"nproc_per_node": 2, "train": {"steps": 100_000}, "telemetry": {"interval_s": 0.5}}

    def nvme_case(name: str, fault: Callable[[LaunchedJob], None]) -> Row:
        work = fresh(name)
        disk = Path(tempfile.mkdtemp(prefix="zr-fault-nvme-", dir="/var/tmp"))
        keys = dict(slow, zero={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(disk)}})
        return _run(name, work, local(TINY, ["--step-delay", "0.05"], **keys), fault, nvme=disk)

    def kill_rank(sig: int) -> Callable[[LaunchedJob], None]:
        def fault(job: LaunchedJob) -> None:
            _wait_steps(job)
            os.kill(_pid_of(job, "localhost:1"), sig)
        return fault

    def kill_relay(job: LaunchedJob) -> None:  # the process torchrun started for rank 1: no exit record from it
        _wait_steps(job)
        job.relay(1).kill()

    def signal_launcher(sig: int, again: bool = False, kill_after_s: float | None = None):
        def fault(job: LaunchedJob) -> None:
            job.wait_for("ready", count=2, timeout=120)
            job.send(sig)
            if again:
                time.sleep(1.0)
                job.send(sig)
            if kill_after_s is not None:
                time.sleep(kill_after_s)
                job.proc.kill()
        return fault

    def ready_then(fn: Callable[[LaunchedJob], None]) -> Callable[[LaunchedJob], None]:
        def fault(job: LaunchedJob) -> None:
            job.wait_for("ready", count=2, timeout=120)
            fn(job)
        return fault

    stubborn = {"launch": {"kill_grace_s": 1.0}}
    table: dict[str, Callable[[], Row]] = {
        "rank exits 3": lambda: _run("rank exits 3", fresh("exit"), local("stubborn.py", ["--fail-rank", "1"]),
                                     lambda job: job.wait_for("rank 1 line 24", timeout=120)),
        "rank SIGKILL": lambda: _run("rank SIGKILL", fresh("kill"), local(TINY, ["--step-delay", "0.05"], **slow),
                                     kill_rank(signal.SIGKILL)),
        "rank SIGKILL with its relay (torchrun's child)": lambda: _run(
            "rank SIGKILL with its relay (torchrun's child)", fresh("kill-relay"),
            local(TINY, ["--step-delay", "0.05"], **slow), kill_relay),
        "rank hangs (collective timeout 10 s)": lambda: _run(
            "rank hangs (collective timeout 10 s)", fresh("hang"),
            local(TINY, ["--sleep-rank", "1", "--sleep-at", "3", "--sleep-s", "120"], nproc_per_node=2,
                  train={"steps": 50}, launch={"timeout_s": 10.0, "kill_grace_s": 1.0},
                  telemetry={"interval_s": 0.5}),
            lambda job: job.wait_for("[localhost:1] sleeping", timeout=120)),
        "rank SIGSTOP (collective timeout 10 s)": lambda: _run(
            "rank SIGSTOP (collective timeout 10 s)", fresh("stop"),
            local(TINY, ["--step-delay", "0.05"], **dict(slow, launch={"timeout_s": 10.0, "kill_grace_s": 1.0})),
            kill_rank(signal.SIGSTOP)),
        "Ctrl-C, workers ignore SIGTERM": lambda: _run(
            "Ctrl-C, workers ignore SIGTERM", fresh("int"), local("stubborn.py", **stubborn),
            signal_launcher(signal.SIGINT)),
        "second Ctrl-C (kill_grace_s 30)": lambda: _run(
            "second Ctrl-C (kill_grace_s 30)", fresh("int2"), local("stubborn.py", launch={"kill_grace_s": 30.0}),
            signal_launcher(signal.SIGINT, again=True)),
        "launcher SIGKILL in its grace wait": lambda: _run(
            "launcher SIGKILL in its grace wait", fresh("kill9"), local("stubborn.py", launch={"kill_grace_s": 5.0}),
            signal_launcher(signal.SIGINT, kill_after_s=1.0), settle_s=30.0),
        "ZerorunError in every rank": lambda: _run(
            "ZerorunError in every rank", fresh("error"),
            local(TINY, nproc_per_node=2, zero={"stage": 2, "offload_optimizer": {
                "device": "nvme", "nvme_path": "/nonexistent/zerorun-nvme"}}), lambda job: None),
        "NVMe offload, Ctrl-C": lambda: nvme_case("NVMe offload, Ctrl-C", lambda job: (_wait_steps(job),
                                                                                      job.send(signal.SIGINT))),
        "NVMe offload, rank SIGKILL": lambda: nvme_case("NVMe offload, rank SIGKILL", kill_rank(signal.SIGKILL)),
    }
    table["rank SIGKILL in a background checkpoint write"] = lambda: _killed_writer(fresh("ckpt-kill"), local)
    table["runs/ disk full (tmpfs of 16 KiB)"] = lambda: _full_runs_disk(fresh("full"))
    table["second job on a running job's checkpoint.dir"] = lambda: _second_job(fresh("second"))
    table["checkpoint disk full (tmpfs of 256 KiB, a save every step)"] = lambda: _full_checkpoint_disk(fresh("ckptfull"))
    table["forged telemetry: a hello without the token, a bad record"] = lambda: _run(
        "forged telemetry: a hello without the token, a bad record", fresh("forged"),
        local(TINY, ["--step-delay", "0.05"], **slow), _forge_then_stop)
    table["rank OOM-killed (a memory cgroup of 200 MB)"] = lambda: _oom_kill(fresh("oom"))
    table["rank SIGKILLed holding a /dev/shm segment"] = lambda: _shm_left(fresh("shm"))
    table["two jobs of one name on one NVMe disk, Ctrl-C to the first"] = lambda: _two_on_one_disk(fresh("two"))
    table["telemetry flood: 200 connections of 1 MB without a newline"] = lambda: _run(
        "telemetry flood: 200 connections of 1 MB without a newline", fresh("flood"),
        local(TINY, ["--step-delay", "0.05"], **slow), _flood_then_stop)
    table["NVMe disk too small (ext4 of 4 MiB)"] = lambda: _small_nvme_disk(fresh("small"))
    table["resume with another precision"] = lambda: _resume_changed(fresh("resume"))
    bomb = "d0: &d0 {" + ", ".join(f"k{j}: 1" for j in range(9)) + "}\n" + "".join(
        f"d{i}: &d{i} {{" + ", ".join(f"k{j}: *d{i - 1}" for j in range(9)) + "}\n" for i in range(1, 9))
    for case, extra, hosts in [("YAML alias bomb (under 1 KB)", bomb, None),
                               ("tagged YAML (!!python/object/apply)", "x: !!python/object/apply:os.getpid []\n", None),
                               ("env key 'A=B'", "env: {'A=B': c}\n", None),
                               ("recipe of 150 KiB", "env: {" + ", ".join(f"P{i}: {'x' * 1000}" for i in range(150))
                                + "}\n", None),
                               ("recipe of 50 MB", "# " + "x" * (50 << 20) + "\n", None),
                               ("hostfile line 'localhost: slots=2'", "", "localhost: slots=2\n"),
                               ("hostfile host '-V'", "", "-V slots=1\n")]:
        table[case] = lambda case=case, extra=extra, hosts=hosts: _bad_input(case, fresh(case[:12]), extra, hosts)
    table.update(_ssh_cases(work_root, fresh))
    return table


def _killed_writer(work: Path, local: Callable[..., Callable[[Path], LaunchedJob]]) -> Row:
    """Rank 1 SIGKILLs itself in its checkpoint writer thread while training goes on (the test hook
    of runtime/checkpoint/sharded.py); the row's leftovers add whether `latest` still names the save before."""
    from zerorun.runtime.checkpoint.sharded import CRASH_ENV

    ckpt = work / "ckpt"
    row = _run("rank SIGKILL in a background checkpoint write", work,
               local("train_checkpointed.py", nproc_per_node=2, train={"steps": 6, "seed": 3}, zero={"stage": 2},
                     checkpoint={"dir": str(ckpt), "every_steps": 2}, env={CRASH_ENV: "1:shard:step-4"},
                     launch={"kill_grace_s": 1.0}), lambda job: None)
    latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").is_file() else "none"
    row.leftovers += f"; latest {latest}"
    return row


def _full_runs_disk(work: Path) -> Row:
    """A job whose workers all succeed while runs/ is a 16 KiB file system (needs root to mount)."""
    import subprocess

    runs = work / "runs"
    runs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(runs)]).returncode != 0:
        return Row("runs/ disk full", None, None, "(cannot mount here)", "-")
    try:
        def start(w: Path) -> LaunchedJob:
            return LaunchedJob.start(write_recipe(w, TINY, [], nproc_per_node=2, train={"steps": 40},
                                                  telemetry={"interval_s": 0.1}), cwd=w)
        return _run("runs/ disk full (tmpfs of 16 KiB), 40 steps succeed", work, start, lambda job: None)
    finally:
        subprocess.run(["umount", "-l", str(runs)])


def _full_checkpoint_disk(work: Path) -> Row:
    """A job saving every step into a 256 KiB file system: how the save that finds it full ends (needs root)."""
    import subprocess

    ckpt = work / "ckpt"
    ckpt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(ckpt)]).returncode != 0:
        return Row("checkpoint disk full", None, None, "(cannot mount here)", "-")
    try:
        start = lambda w: LaunchedJob.start(write_recipe(w, "train_checkpointed.py", [], train={"steps": 500},  # noqa: E731
                                                         checkpoint={"dir": str(ckpt), "every_steps": 1}), cwd=w)
        return _run("checkpoint disk full (tmpfs of 256 KiB, a save every step)", work, start, lambda job: None)
    finally:
        subprocess.run(["umount", "-l", str(ckpt)])


def _second_job(work: Path) -> Row:
    """A job started on the checkpoint.dir (and run name) of a job that is running: the second one's ending."""
    keys = {"name": "shared", "checkpoint": {"dir": str(work / "ckpt")}}
    first = LaunchedJob.start(write_recipe(work, "stubborn.py", [], **keys), cwd=work)
    try:
        first.wait_for("ready", count=2, timeout=120)
        (work / "second").mkdir()
        start = lambda w: LaunchedJob.start(write_recipe(w, "stubborn.py", [], **keys), cwd=w)  # noqa: E731
        return _run("second job on a running job's checkpoint.dir", work / "second", start, lambda job: None)
    finally:
        first.cleanup()


def _forge_then_stop(job: LaunchedJob) -> None:
    """Speak to the job's collector as a stranger would: no token, then a record that breaks the schema."""
    import socket

    _wait_steps(job)
    env = psutil.Process(_pid_of(job, "localhost:0")).environ()
    host, port = env["ZERORUN_TELEMETRY"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b'{"type":"hello","rank":0,"t":1,"host":"innocent","pid":1,"pid_start":null}\n'
                     b'{"type":"sample","rank":0,"t":1,"cuda":5}\n')
    time.sleep(2.0)
    job.send(signal.SIGINT)


def _oom_kill(work: Path) -> Row:
    """Rank 1 moves into a memory cgroup of 200 MB and allocates 600 MB: the kernel's OOM killer ends it."""
    from tests.launch.test_hostile import OOM_SCRIPT, _memory_cgroup

    group = _memory_cgroup(200 << 20)
    if group is None:
        return Row("rank OOM-killed", None, None, "(cannot make a memory cgroup here)", "-")
    try:
        (work / "oom.py").write_text(OOM_SCRIPT)
        start = lambda w: LaunchedJob.start(write_recipe(w, str(w / "oom.py"), [str(group / "cgroup.procs")],  # noqa: E731
                                                         telemetry={"interval_s": 0.2}), cwd=w)
        return _run("rank OOM-killed (a memory cgroup of 200 MB)", work, start, lambda job: None)
    finally:
        group.rmdir()


def _shm_left(work: Path) -> Row:
    """A rank writes a segment into /dev/shm named as the runtime names its own, then SIGKILLs itself."""
    from tests.launch.test_hostile import SHM_SCRIPT

    (work / "shm.py").write_text(SHM_SCRIPT)
    start = lambda w: LaunchedJob.start(write_recipe(w, str(w / "shm.py")), cwd=w)  # noqa: E731
    return _run("rank SIGKILLed holding a /dev/shm segment", work, start, lambda job: None)


def _two_on_one_disk(work: Path) -> Row:
    """Two jobs of one name (two working directories) offload to one NVMe disk; the first gets Ctrl-C.
    The row adds whether the second job still runs with all of its offload files."""
    disk = Path(tempfile.mkdtemp(prefix="zr-fault-nvme-", dir="/var/tmp"))
    keys = {"name": "same", "nproc_per_node": 2, "train": {"steps": 100_000},
            "zero": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(disk)}}}
    (work / "b").mkdir()
    second = LaunchedJob.start(write_recipe(work / "b", TINY, ["--step-delay", "0.05"], **keys), cwd=work / "b")
    try:
        _wait_steps(second)
        (work / "a").mkdir()
        start = lambda w: LaunchedJob.start(write_recipe(w, TINY, ["--step-delay", "0.05"], **keys), cwd=w)  # noqa: E731
        row = _run("two jobs of one name on one NVMe disk, Ctrl-C to the first", work / "a", start,
                   lambda job: (_wait_steps(job), job.send(signal.SIGINT)))
        theirs = [p for p in disk.rglob("*.bin") if second.job_id in str(p)]
        others = [p for p in disk.rglob("*.bin") if second.job_id not in str(p)]
        row.leftovers += (f"; the other job {'runs' if second.proc.poll() is None else 'ended'} with "
                          f"{len(theirs)} offload files, {len(others)} files not its own")
        return row
    finally:
        second.cleanup()


def _flood_then_stop(job: LaunchedJob) -> None:
    """200 connections that each send 1 MB without a newline and never prove the token; the launcher's
    RSS before and after goes into the job's stderr lines the table shows."""
    import socket

    _wait_steps(job)
    env = psutil.Process(_pid_of(job, "localhost:0")).environ()
    host, port = env["ZERORUN_TELEMETRY"].rsplit(":", 1)
    launcher = psutil.Process(job.proc.pid)
    before = launcher.memory_info().rss
    sockets = []
    for _ in range(200):
        try:
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.setblocking(False)
            sock.send(b"x" * (1 << 20))
            sockets.append(sock)
        except OSError:
            continue
    time.sleep(2.0)
    grown = (launcher.memory_info().rss - before) >> 20
    for sock in sockets:
        sock.close()
    job.stderr.append(f"zerorun: warning: (table) launcher RSS grew {grown} MiB under the flood; "
                      f"job {'still training' if job.proc.poll() is None else 'ended'}")
    job.send(signal.SIGINT)


_WIDE_SCRIPT = """
import torch, zerorun
engine = zerorun.initialize(torch.nn.Linear(1024, 1024), None)  # 1M parameters: 12 MB of optimizer state
engine.backward(engine(torch.randn(2, 1024)).sum())
engine.step()
"""


def _small_nvme_disk(work: Path) -> Row:
    """Optimizer states offloaded to an ext4 file system of 4 MiB (a loop device: tmpfs is refused for
    NVMe offload): how the job is refused (needs root to mount)."""
    import subprocess

    disk, image = work / "nvme", work / "nvme.img"
    disk.mkdir()
    made = subprocess.run(["mkfs.ext4", "-q", str(image), "4M"], capture_output=True).returncode == 0
    if not made or subprocess.run(["mount", "-o", "loop", str(image), str(disk)]).returncode != 0:
        return Row("NVMe disk too small", None, None, "(cannot make a loop file system here)", "-")
    try:
        (work / "wide.py").write_text(_WIDE_SCRIPT)
        keys = {"nproc_per_node": 2, "zero": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                               "nvme_path": str(disk)}}}
        start = lambda w: LaunchedJob.start(write_recipe(w, str(w / "wide.py"), [], **keys), cwd=w)  # noqa: E731
        return _run("NVMe disk too small (ext4 of 4 MiB)", work, start, lambda job: None)
    finally:
        subprocess.run(["umount", "-l", str(disk)])


def _resume_changed(work: Path) -> Row:
    """A job saves a checkpoint in fp32; the next resumes from it with precision bf16."""
    keys = {"train": {"steps": 2}, "checkpoint": {"dir": str(work / "ckpt"), "every_steps": 2},
            "launch": {"kill_grace_s": 1.0}}
    first = LaunchedJob.start(write_recipe(work, "train_checkpointed.py", [], **keys), cwd=work)
    if first.wait(timeout=180) != 0:
        first.cleanup()
        return Row("resume with another precision", None, first.proc.returncode, "(the first job failed)", "-")
    keys = dict(keys, train={"steps": 4}, precision="bf16")
    start = lambda w: LaunchedJob.start(write_recipe(w, "train_checkpointed.py", [], **keys), cwd=w)  # noqa: E731
    return _run("resume with another precision", work, start, lambda job: None)


def _bad_input(case: str, work: Path, extra: str, hosts: str | None) -> Row:
    """A launch of a recipe with `extra` appended (and a hostfile of `hosts`): how it is refused, or that it runs."""
    recipe = write_recipe(work, "allreduce.py")
    flags: list[str] = []
    if hosts is not None:
        (work / "hosts").write_text(hosts)
        flags = ["--hostfile", str(work / "hosts")]
    recipe.write_text(recipe.read_text() + extra)
    return _run(case, work, lambda w: LaunchedJob.start(recipe, *flags, cwd=w), lambda job: None)


def _ssh_cases(work_root: Path, fresh: Callable[[str], Path]) -> dict[str, Callable[[], Row]]:
    from tests.launch.sshd import PrivateSSHD, find_sshd

    if find_sshd() is None:
        return {}
    server: list[PrivateSSHD] = []

    def start(script: str, args: list[str] = (), **keys: object) -> Callable[[Path], LaunchedJob]:
        def run(work: Path) -> LaunchedJob:
            if not server:
                server.append(PrivateSSHD.start(Path(tempfile.mkdtemp(prefix="zr-fault-sshd-"))))
            sshd = server[0]
            hosts = work / "hosts"
            hosts.write_text("".join(f"{host} slots=1\n" for host in sshd.hosts))
            recipe = write_recipe(work, script, args, ssh=sshd.recipe_section(),
                                  launch={"kill_grace_s": 1.0, "transport": "ssh"}, **keys)
            return LaunchedJob.start(recipe, "--hostfile", str(hosts), cwd=work)
        return run

    def client_of(job: LaunchedJob, host: str) -> psutil.Process:
        for proc in psutil.Process(job.proc.pid).children(recursive=True):
            try:
                if proc.name() == "ssh" and host in proc.cmdline():
                    return proc
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no ssh client to {host}:\n{job.output}")

    def ready_then(fn: Callable[[LaunchedJob], None]) -> Callable[[LaunchedJob], None]:
        def fault(job: LaunchedJob) -> None:
            job.wait_for("ready", count=2, timeout=120)
            fn(job)
        return fault

    return {
        "ssh: remote rank exits 3": lambda: _run("ssh: remote rank exits 3", fresh("ssh-exit"),
                                                 start("stubborn.py", ["--fail-rank", "1"]),
                                                 lambda job: job.wait_for("rank 1 line 24", timeout=120)),
        "ssh: client SIGKILL": lambda: _run("ssh: client SIGKILL", fresh("ssh-kill"), start("stubborn.py"),
                                            ready_then(lambda job: client_of(job, "127.0.0.2").kill())),
        "ssh: half-open link (client SIGSTOP)": lambda: _run(
            "ssh: half-open link (client SIGSTOP)", fresh("ssh-stop"), start("stubborn.py"),
            ready_then(lambda job: client_of(job, "127.0.0.2").send_signal(signal.SIGSTOP))),
        "ssh: half-open link while training": lambda: _run(
            "ssh: half-open link while training", fresh("ssh-stop-train"),
            start(TINY, ["--step-delay", "0.05"], train={"steps": 100_000}),
            lambda job: (_wait_steps(job), client_of(job, "127.0.0.2").send_signal(signal.SIGSTOP))),
        "ssh: Ctrl-C": lambda: _run("ssh: Ctrl-C", fresh("ssh-int"), start("stubborn.py"),
                                    ready_then(lambda job: job.send(signal.SIGINT))),
    }


def main(argv: list[str]) -> None:
    work_root = Path(tempfile.mkdtemp(prefix="zr-faults-"))
    table = cases(work_root)
    chosen = [name for name in table if not argv or any(arg in name for arg in argv)]
    print("| case | seconds to exit | exit code | cause named | left behind |")
    print("|---|---|---|---|---|")
    for name in chosen:
        row = table[name]()
        seconds = "-" if row.seconds is None else f"{row.seconds:.1f}"
        print(f"| {row.case} | {seconds} | {row.code} | {row.cause} | {row.leftovers} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
