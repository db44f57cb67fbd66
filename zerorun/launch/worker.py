"""Worker bootstrap: what torchrun runs on every rank, `python -m zerorun.launch.worker -- script args`.

1. Fork the output relay (`streams.relay_from_child`) before anything heavy is imported, so that
   every line this rank prints, Python or C, reaches the launcher as `[host:rank] line` and the
   launcher learns how the rank ended.
2. Join the process group: `init_distributed(recipe.launch.timeout_s)` (nccl on CUDA, gloo on CPU).
   The recipe comes from the environment the launcher set; `zerorun.recipe()` reads it there too.
3. Register `faulthandler` for SIGUSR1: on that signal every thread's Python stack goes to stderr
   (and so through the relay); the launcher's stall report uses it. Start the telemetry probe when
   the launcher gave a collector address (`ZERORUN_TELEMETRY`) and `telemetry.enabled`.
4. Run the user's script as `__main__` with `runpy`, with `sys.argv` and `sys.path[0]` as
   `python script.py args` would set them. Nothing is seeded: that is the script's (or the
   engine's) business.
   The script's own `dist.init_process_group(...)` joins the job (runtime/interop/process_group.py).
5. Wait for a checkpoint still being written in the background (`checkpoint.background.wait_all`):
   the job ends once it is committed, or with its error. Then the ranks meet a last time through the
   newest engine's checked collectives: a rank whose peers still train (a data loader that ran out on
   one rank) stops them all with a message naming where each was, instead of leaving them waiting.
6. Stop the probe (a last sample and what is still queued, for at most 2 s). Destroy the process
   group on a clean exit. After a failure it is left alone: tearing down a communicator whose
   peers are gone can block, and the process is about to end anyway.

An exception in the script prints its usual traceback (without this module's frames) and exits 1.
A `ZerorunError` (a problem the user can fix, raised by zerorun inside the script) prints its
one-line message as `zerorun: error: ...` and exits 2, as the CLI does; every rank usually hits the
same one, and the launcher shows it once per job.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import runpy
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

from zerorun.errors import ZerorunError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV, streams, warm
from zerorun.telemetry import ADDRESS_ENV

STACK_SIGNAL = signal.SIGUSR1  # `kill -USR1 <pid>` prints a worker's Python stacks
USER_ERROR = 2  # the exit status of a ZerorunError, as the CLI's

USAGE = "usage: python -m zerorun.launch.worker -- SCRIPT [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    args = script_args(sys.argv[1:] if argv is None else argv)
    host = os.environ.get(NODE_HOST_ENV) or socket.gethostname()
    rank = os.environ.get("RANK", "0")
    streams.relay_from_child(host, rank, exit_record=JOB_ID_ENV in os.environ)  # returns in the rank, if forked here
    sys.exit(run_script(args[0], args[1:]))


def script_args(argv: list[str]) -> list[str]:
    """The script and its arguments from the worker's command line (usage and exit 2 without a script)."""
    args = list(argv)
    if args[:1] == ["--"]:  # argparse in some Python versions keeps torchrun's `--`, others drop it
        args = args[1:]
    if not args:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    return args


def run_script(script: str, args: list[str]) -> int:
    """Join the process group, run `script` as `__main__`, and return the process exit code."""
    from zerorun import config
    from zerorun.runtime.comm.dist import init_distributed

    recipe = config.from_env()
    info = init_distributed(recipe.launch.timeout_s if recipe else 300.0)
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    stop_probe = _start_probe(recipe, info)
    if recipe is not None and recipe.launch.deepspeed_compat:  # `import deepspeed` gets zerorun.compat's API
        from zerorun.compat import shim

        args = shim.install(recipe, args)
    from zerorun.runtime import host_allocator, interop

    host_allocator.install()  # zero.host_memory: this process's allocator follows each engine's setup
    # before the script imports clip_grad_norm_ or destroy_process_group (runtime/interop/): a clip call on the
    # engine's parameters reaches the engine, and the script's own teardown settles the engines first
    release_interop = interop.hold_for_script()
    # What the bootstrap imported (torch, the runtime) leaves the collector's reach before the script runs, as a warm
    # rank's zygote did: a full collection, the one at exit above all, no longer walks it. In a warm rank this walks
    # only what the rank made since its fork.
    warm.freeze_imports()
    script = os.path.abspath(script)
    sys.argv = [script, *args]
    # The script's directory comes first, as for `python script.py`; the entries after it stay, so
    # that a zerorun checkout found through the working directory remains importable.
    sys.path.insert(0, os.path.dirname(script))
    namespace: dict[str, Any] = {}
    try:
        namespace = _run_path(script)  # kept: the probe's last sample sees the engine
        _meet_at_the_end()
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except ZerorunError as exc:  # the user's to fix, and the message says how: no traceback
        print("zerorun: error: " + str(exc).replace("\n", "\n  "), file=sys.stderr)  # more lines: indented
        code = USER_ERROR
    except BaseException as exc:  # noqa: BLE001 - the user's error, reported as Python would
        _print_user_traceback(exc, script)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    if stop_probe is not None:
        stop_probe()
    namespace.clear()
    gc.collect()  # the script's objects in cycles too (its functions hold its globals), while the hold below keeps
    # the groups it destroyed: none is destroyed inside a DDP Reducer's free, with the GIL held (interop/process_group.py)
    release_interop()  # torch's own functions again (an engine still alive holds its own until it goes)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        _destroy_process_group()
    return code


def _run_path(script: str) -> dict[str, Any]:
    """Run the script as `__main__`; the moment it returns or raises, the probe (if any) stops reporting where it is."""
    from zerorun.runtime import context
    from zerorun.telemetry import probe, profile

    raised: BaseException | None = None
    try:
        namespace = runpy.run_path(script, run_name="__main__")
        # a background save commits before the job ends, or its error ends it; a script that never imported the
        # checkpoints (plain DDP, no engine) started none, and its rank is spared their import (0.2-0.5 s)
        checkpoint_async = sys.modules.get("zerorun.runtime.checkpoint.background")
        if checkpoint_async is not None:
            checkpoint_async.wait_all(context.current())
        return namespace
    except BaseException as exc:
        raised = exc
        raise
    finally:
        profile.finish()  # a window the script ended inside writes what it recorded
        probe.script_ended(raised)


def _start_probe(recipe: Any, info: Any) -> Callable[[], None] | None:
    """Start this rank's telemetry probe; return its stop function (None: no collector, or telemetry off)."""
    address = os.environ.get(ADDRESS_ENV)
    if not address or recipe is None or not recipe.telemetry.enabled:
        return None
    try:
        from zerorun.telemetry import probe

        host = os.environ.get(NODE_HOST_ENV) or socket.gethostname()
        probe.start(address, recipe.telemetry, info.rank, host, info.device)
        return probe.stop
    except Exception as exc:  # noqa: BLE001 - telemetry must never stop training
        print(f"zerorun: telemetry off on this rank: {exc!r}", file=sys.stderr)
        return None


def _exit_code(value: object) -> int:
    """The status `sys.exit(value)` gives: None -> 0, an int as is, anything else printed -> 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _print_user_traceback(exc: BaseException, script: str) -> None:
    """Print the traceback from the script's first frame on, like `python script.py` would."""
    walk: TracebackType | None = exc.__traceback__
    while walk is not None and os.path.abspath(walk.tb_frame.f_code.co_filename) != script:
        walk = walk.tb_next
    traceback.print_exception(type(exc), exc, walk)  # None: the script did not start (SyntaxError)


def _meet_at_the_end() -> None:
    """Once every rank is done with its collectives, meet: through the newest engine's checked collectives where
    one lives (a rank still training meets this as a mismatch, and every rank stops naming it), else a barrier.

    The engines' collectives still in flight are finished first. Without the meeting a rank whose last collective
    finished early closes its connections while a peer may still be receiving. Either one left out aborts the
    process at exit ("terminate called without an active exception")."""
    import torch.distributed as dist

    from zerorun.runtime import context

    if not dist.is_initialized():  # the script destroyed it itself (and met there), or never had one
        return
    engines = context.current().engines
    engines.settle_all()
    if not engines.end_of_script():
        dist.barrier()


def _destroy_process_group() -> None:
    """Tear the process group down (every rank met at the end of its script)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
