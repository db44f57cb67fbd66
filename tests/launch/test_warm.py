"""Warm ranks (`zerorun.launch.warm`): a node's ranks are forked from its zygote, and behave as fresh interpreters.

Each test runs the node's torchrun (`python -m zerorun.launch.torchrun`) on two ranks, without the launcher, so
that what it checks is the fork and the relay: who the rank's parent is, what it inherited, what reaches it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from zerorun.launch import streams, warm

IDENTITY = """
import os, random, sys, numpy, psutil, torch
parent = psutil.Process(os.getppid()).cmdline()
print("who", os.environ["RANK"], os.environ["LOCAL_RANK"], os.getpid(), " ".join(parent), flush=True)
print("fresh", os.environ["RANK"], random.random(), numpy.random.random(), torch.get_num_threads(),
      os.getcwd(), os.getsid(0) == os.getpid(), sys.argv[1:], flush=True)
print("drawn", os.environ["RANK"], torch.initial_seed(), torch.rand(1).item(), flush=True)
import gc, weakref
class Cycle: pass
cycle = Cycle(); cycle.me = cycle; gone = weakref.ref(cycle); del cycle
print("gc", os.environ["RANK"], gc.get_freeze_count(), gc.collect() > 0 and gone() is None, flush=True)
"""

STAY = """
import os, signal, subprocess, sys, time
def ended(signum, frame):
    print("got", signal.Signals(signum).name, flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, ended)
child = subprocess.Popen(["sleep", "60"])
print("ready", os.getpid(), child.pid, flush=True)
time.sleep(60)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp_path: Path, body: str, *, module: str = "zerorun.launch.torchrun",
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    script = tmp_path / "script.py"
    script.write_text(body)
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", warm.ADDRESS_ENV, warm.SWITCH_ENV)}
    argv = [sys.executable, "-m", module, "--nproc-per-node", "2", "--rdzv-backend", "static",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "--max-restarts", "0",
            "--monitor-interval", "0.1", "-m", "zerorun.launch.worker", "--", str(script), "--flag", "x"]
    return subprocess.Popen(argv, cwd=tmp_path, env={**clean, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _lines(proc: subprocess.Popen[str], word: str, count: int = 2) -> list[list[str]]:
    """The first `count` lines that start (after the `[host:rank] ` prefix) with `word`, split."""
    found = []
    assert proc.stdout is not None
    for line in proc.stdout:
        fields = line.split()
        if len(fields) > 1 and fields[1] == word:
            found.append(fields[2:])
            if len(found) == count:
                return found
    raise AssertionError(f"torchrun ended (status {proc.wait()}) before {count} '{word}' lines")


def _finished(proc: subprocess.Popen[str], *words: str) -> list[list[list[str]]]:
    """For each word, the lines (split, after the `[host:rank]` prefix) that start with it, in rank order, of a run
    that ends well by itself."""
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return [sorted(line.split()[2:] for line in out.splitlines() if line.split()[1:2] == [word]) for word in words]


def test_ranks_are_forked_by_the_zygote_and_look_like_fresh_interpreters(tmp_path: Path) -> None:
    who, fresh, drawn, collected = _finished(_torchrun(tmp_path, IDENTITY), "who", "fresh", "drawn", "gc")
    assert [w[:2] for w in who] == [["0", "0"], ["1", "1"]]
    assert all("zerorun.launch.torchrun" in " ".join(w[3:]) for w in who), who  # the zygote: the node torchrun's fork
    (rank0, rank1) = fresh
    assert rank0[1] != rank1[1] and rank0[2] != rank1[2], fresh  # random's and numpy's seeds: each rank its own
    import torch  # torch's: each rank its own where this torch seeds a fresh process from the OS, else its fixed one

    fixed = torch.initial_seed() == warm.TORCH_FIXED_SEED
    assert (drawn[0] == drawn[1]) if fixed else (drawn[0][0] != drawn[1][0] and drawn[0][1] != drawn[1][1]), drawn
    # torchrun gives each of 2 workers 1 OpenMP thread where OMP_NUM_THREADS is unset; the zygote read its own at import
    assert rank0[3] == rank1[3] == "1"
    assert rank0[4] == rank1[4] == str(tmp_path) and rank0[5] == "True"
    assert " ".join(rank0[6:]) == "['--flag', 'x']"
    # what the zygote imported is frozen (torch alone: over 100,000 objects), what the script makes is collected
    assert all(int(frozen) > 10_000 and cycle == "True" for _, frozen, cycle in collected), collected


def test_without_a_zygote_the_relay_forks_its_rank_itself(tmp_path: Path) -> None:
    (who,) = _finished(_torchrun(tmp_path, IDENTITY, module="torch.distributed.run",
                                 env={warm.ADDRESS_ENV: "zerorun-warm-nobody"}), "who")
    assert all("zerorun.launch.worker" in " ".join(w[3:]) for w in who), who  # the relay: the process torchrun started


def test_switched_off_the_node_torchrun_forks_no_zygote(tmp_path: Path) -> None:
    (who,) = _finished(_torchrun(tmp_path, IDENTITY, env={warm.SWITCH_ENV: "0"}), "who")
    assert all("zerorun.launch.worker" in " ".join(w[3:]) for w in who), who


def _relays(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children() if "zerorun.launch.worker" in " ".join(p.cmdline())]


def test_torchruns_sigterm_to_a_relays_group_reaches_its_forked_rank(tmp_path: Path) -> None:
    proc = _torchrun(tmp_path, STAY)
    _lines(proc, "ready")
    for relay in _relays(proc):
        os.killpg(relay.pid, signal.SIGTERM)  # what torchrun does to stop its workers
    got = _lines(proc, "got")
    assert got == [["SIGTERM"], ["SIGTERM"]]
    assert proc.wait(60) != 0


def test_a_rank_and_its_children_die_with_their_relay(tmp_path: Path) -> None:
    proc = _torchrun(tmp_path, STAY)
    ready = _lines(proc, "ready")
    pids = [int(pid) for line in ready for pid in line]
    try:
        for relay in _relays(proc):
            os.killpg(relay.pid, signal.SIGKILL)  # takes the relay alone: the rank has a session of its own
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, [psutil.Process(p).cmdline() for p in pids if psutil.pid_exists(p)]
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_zygote_that_initialised_cuda_forks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        read, write = os.pipe()
        try:
            assert warm._zygote(listener, read) is None  # relays then fork their ranks themselves
        finally:
            os.close(read)
            os.close(write)


def test_the_zygotes_imports_never_reach_the_cuda_driver() -> None:
    """A process forked after CUDA's driver was initialised (even by a device count) cannot use CUDA: the zygote's
    imports must not ask. Checked here where there is no GPU by recording every way torch reaches the driver."""
    probe = f"""
import torch
asked = []
for name in ("_cuda_getDeviceCount", "_cuda_init", "_cuda_getDevice"):
    if hasattr(torch._C, name):
        setattr(torch._C, name, lambda *a, name=name: asked.append(name) or 0)
for name in ("is_available", "device_count", "init", "current_device"):
    setattr(torch.cuda, name, lambda *a, name=name: asked.append(name) or 0)
for module in {warm.PRELOAD!r}:
    __import__(module)
print(asked)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_ranks_outlive_their_zygote_and_their_relays_still_report_how_they_ended(tmp_path: Path) -> None:
    body = ("import os, sys, time\nprint('ready', os.getpid(), os.getppid(), flush=True)\ntime.sleep(3)\n"
            "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    proc = _torchrun(tmp_path, body, env={"ZERORUN_JOB_ID": "warm-test"})  # relays write exit records for a job
    (zygote,) = {int(line[1]) for line in _lines(proc, "ready")}
    os.kill(zygote, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    mark = streams.EXIT_RECORD.decode()  # "\x1e...": splitlines() would split there
    records = [json.loads(line.split(mark, 1)[1]) for line in out.split("\n") if mark in line]
    assert sorted((r["rank"], r["code"], r["signal"]) for r in records) == [(0, 0, None), (1, 3, None)], out


def test_a_relay_whose_zygote_never_forks_forks_its_rank_itself_and_a_late_fork_would_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"zerorun-warm-test-{os.getpid()}"
    received: list[list[int]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind("\0" + name)
        listener.listen(1)

        def hung_zygote() -> None:  # takes the request, never answers (an import that hangs)
            conn, _ = listener.accept()
            received.append(socket.recv_fds(conn, 8, 5)[1])
            conn.recv(1 << 20)
            time.sleep(2)
            conn.close()

        zygote = threading.Thread(target=hung_zygote, daemon=True)
        zygote.start()
        monkeypatch.setenv(warm.ADDRESS_ENV, name)
        monkeypatch.setattr(warm, "_FORK_TIMEOUT_S", 0.5)
        out_r, out_w = os.pipe()
        try:
            assert warm.request_rank(out_w, out_w) is None  # the relay forks its own rank
            child = os.fork()  # what the zygote would do with the request it holds, once its import ends
            if child == 0:
                warm.become(warm.Request(received[0], dict(os.environ), "/", []))
                os._exit(0)  # the fork became a second rank
            assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 1
        finally:
            for fd in (out_r, out_w, *received[0]):
                os.close(fd)
        zygote.join()


# -- the script's heavy libraries, imported once by the zygote (warm_libraries) --------------------------------------
# A stand-in for accelerate beside the script: the zygote imports it from there, as the rank would (the worker puts
# the script's directory first on sys.path), so these run where neither transformers nor accelerate is installed.
LIBRARY = """
import os, numpy
from torch.nn.utils import clip_grad_norm_
IMPORTED_BY = os.getpid()
numpy.random.random()  # numpy's global generator seeded at its first draw, in the zygote
"""
USES_LIBRARY = """
import os, sys
import accelerate
print("lib", os.environ["RANK"], accelerate.IMPORTED_BY != os.getpid(),
      getattr(accelerate.clip_grad_norm_, "_zerorun_routed", False), flush=True)
"""


def test_a_library_the_script_imports_is_imported_once_by_the_zygote_as_the_rank_would(tmp_path: Path) -> None:
    (tmp_path / "accelerate.py").write_text(LIBRARY)
    warm_lines, who, fresh = _finished(_torchrun(tmp_path, USES_LIBRARY + IDENTITY), "lib", "who", "fresh")
    assert warm_lines == [["0", "True", "True"], ["1", "True", "True"]], warm_lines  # imported by another process
    assert all("zerorun.launch.torchrun" in " ".join(w[3:]) for w in who), who
    assert fresh[0][2] != fresh[1][2], fresh  # numpy's draws: each rank its own, as in fresh interpreters
    # a fresh rank imports it itself, with the clip function zerorun routes while the script runs bound alike
    (cold,) = _finished(_torchrun(tmp_path, USES_LIBRARY, env={warm.SWITCH_ENV: "0"}), "lib")
    assert cold == [["0", "False", "True"], ["1", "False", "True"]], cold


@pytest.mark.parametrize("library,why", [
    ("import threading, time\nthreading.Thread(target=time.sleep, args=(20,), daemon=True).start()\n",
     "importing accelerate started a thread"),
    # a CUDA build of torch asks the driver for the count under is_available (a CPU build answers by itself)
    ("import torch\ntorch.cuda.is_available()\n", r"importing accelerate asked torch about CUDA \([^)]*is_available")],
    ids=["thread", "cuda"])
def test_a_library_that_could_import_otherwise_in_a_rank_leaves_every_rank_fresh(tmp_path: Path, library: str,
                                                                                  why: str) -> None:
    (tmp_path / "accelerate.py").write_text(library + "IMPORTED_BY = 0\nclip_grad_norm_ = None\n")
    proc = _torchrun(tmp_path, USES_LIBRARY + IDENTITY)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert re.search(f"zerorun: every rank of this node imports its own libraries: {why}", out), out
    who = [line.split()[2:] for line in out.splitlines() if line.split()[1:2] == ["who"]]
    assert len(who) == 2 and all("zerorun.launch.worker" in " ".join(w[3:]) for w in who), out


def test_the_zygote_imports_only_the_libraries_of_the_scripts_leading_imports(tmp_path: Path) -> None:
    from zerorun.launch.warm_libraries import script_imports

    script = tmp_path / "train.py"
    script.write_text('"""A docstring."""\nfrom __future__ import annotations\nimport os, transformers.trainer_utils\n'
                      "from transformers import Trainer, TrainingArguments\nimport torch\nfrom accelerate import *\n"
                      "from . import local\nimport accelerate.utils\n")
    assert script_imports(str(script)) == [("transformers.trainer_utils", ()),
                                           ("transformers", ("Trainer", "TrainingArguments")), ("accelerate", ())]
    for before in ('os.environ["HF_HUB_OFFLINE"] = "1"', "import my_settings", 'sys.path.insert(0, "vendor")',
                   "try:\n    import apex\nexcept ImportError:\n    pass", "def main():\n    import accelerate"):
        script.write_text(f"import os, sys\n{before}\nimport transformers\n")  # may change what the import reads
        assert script_imports(str(script)) == [], before
    script.write_text("import transformers\ndef broken(:\n")
    assert script_imports(str(script)) == [] and script_imports(str(tmp_path / "missing.py")) == []


def test_a_script_that_sets_the_environment_before_its_libraries_imports_them_in_each_rank(tmp_path: Path) -> None:
    (tmp_path / "accelerate.py").write_text("import os\nSEEN = os.environ.get('ZR_SETTING')\n")
    body = "import os, sys\nos.environ['ZR_SETTING'] = 'set'\nimport accelerate\nprint('saw', accelerate.SEEN)\n"
    (saw,) = _finished(_torchrun(tmp_path, body), "saw")
    assert saw == [["set"], ["set"]], saw


PER_RANK = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING")  # what torchrun sets for each worker, and TORCHELASTIC_*


def test_the_real_libraries_read_nothing_of_a_rank_at_import_ask_no_cuda_and_start_no_thread() -> None:
    """Why warm_libraries.LIBRARIES may be imported before the fork: what a Trainer script imports, recorded."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    probe = """
import json, os, sys, threading
import torch
reads = set()
environ = type(os.environ)
for method in ("__getitem__", "__contains__"):
    def traced(self, key, original=getattr(environ, method)):
        reads.add(key)
        return original(self, key)
    setattr(environ, method, traced)
from zerorun.launch import warm_libraries
with warm_libraries._cuda_asked() as asked:
    warm_libraries._run([("transformers", ("Trainer", "TrainingArguments", "HfArgumentParser", "GPT2LMHeadModel")),
                         ("accelerate", ("Accelerator",))])
print(json.dumps([sorted(reads), asked, threading.active_count(), "transformers.trainer" in sys.modules]))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reads, asked, threads, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded and asked == [] and threads == 1
    assert [key for key in reads if key in PER_RANK or key.startswith("TORCHELASTIC_")] == [], reads
