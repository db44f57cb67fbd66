"""Workers that are hard to stop, and optionally one that fails.

Every rank prints `pid N` for itself and joins a barrier. Then, unless it is `--fail-rank`, it
ignores SIGTERM and leaves behind two processes that ignore SIGTERM too:
- a child in its own process group (like a dataloader worker that does not quit), and
- a daemon in a session of its own whose parent has already exited, so it is neither in the
  worker's process group nor in torchrun's process tree: only the job id in its environment
  leads to it.
It prints `pid N` for both, then `ready`, and sleeps. The launcher can only end them with SIGKILL.
`--fail-rank R` makes rank R print 25 numbered lines and then exit with `--code` (or raise, with
`--raise-error`).
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist

SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
DAEMONIZE = ("import subprocess, sys; "
             f"p = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session=True, "
             "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--code", type=int, default=3)
parser.add_argument("--raise-error", action="store_true")
args = parser.parse_args()

rank = dist.get_rank()
print(f"pid {os.getpid()}", flush=True)
dist.barrier()
if rank == args.fail_rank:
    for i in range(25):
        print(f"rank {rank} line {i}", flush=True)
    if args.raise_error:
        raise RuntimeError(f"rank {rank} fails on purpose")
    sys.exit(args.code)

signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", SLEEPER])
daemon_pid = int(subprocess.run([sys.executable, "-c", DAEMONIZE], capture_output=True, text=True).stdout)
print(f"pid {child.pid}", flush=True)
print(f"pid {daemon_pid}", flush=True)
print("ready", flush=True)
time.sleep(120)
