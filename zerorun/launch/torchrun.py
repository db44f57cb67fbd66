"""A node's torchrun, with warm ranks: `python -m zerorun.launch.torchrun <torchrun's own arguments>`.

This is `python -m torch.distributed.run` (its parser, its agent, its rendezvous, its teardown), run after
one step of ours: when the workers are zerorun's (`-m zerorun.launch.worker`), the zygote is forked first
(`warm`), so that every rank of the node starts from a process that has already imported torch instead of
importing it again. Any other entrypoint, or `ZERORUN_WARM_RANKS=0`, runs torchrun exactly as it is.
"""

from __future__ import annotations

import sys

WORKER_ENTRY = ("-m", "zerorun.launch.worker")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    from zerorun.launch import warm

    zygote = None
    if warm.enabled() and _runs_the_worker(args):
        import torch  # noqa: F401 - before the fork: the zygote and torchrun's agent share this import

        started = warm.start(_script(args))
        if isinstance(started, warm.Request):  # this process is now a rank the zygote forked for a relay
            from zerorun.launch import worker

            note_exit = warm.become(started)
            script = worker.script_args(started.argv[1:])
            code = worker.run_script(script[0], script[1:])
            note_exit(code)
            sys.exit(code)
        zygote = started
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    finally:
        if zygote is not None:
            zygote.stop()


def _script(args: list[str]) -> str | None:
    """The user's script: the worker's first argument after its `-m zerorun.launch.worker` (and a `--`)."""
    for i in range(len(args) - 1):
        if tuple(args[i:i + 2]) == WORKER_ENTRY:
            rest = args[i + 2:]
            rest = rest[1:] if rest[:1] == ["--"] else rest
            return rest[0] if rest else None
    return None


def _runs_the_worker(args: list[str]) -> bool:
    """Whether torchrun's entrypoint is zerorun's worker (`-m zerorun.launch.worker`, before any `--`)."""
    head = args[:args.index("--")] if "--" in args else args
    return any(tuple(head[i:i + 2]) == WORKER_ENTRY for i in range(len(head) - 1))


if __name__ == "__main__":
    main()
