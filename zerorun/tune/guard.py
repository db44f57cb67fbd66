"""One trial's launcher process: `zerorun launch` that ends its job when the tuner that started it is gone.

    python -m zerorun.tune.guard '{"recipe": "r.yaml", "parent": 4242, "options": {"overrides": [...]}}'

The tuner starts every trial this way, so each trial runs through the normal launcher
(`launch.launcher.make_plan` and `run`, exactly what `zerorun launch` calls) in fresh worker
processes. The one addition: a watcher thread that sends this process SIGTERM once its parent
(the tuner) has died, e.g. killed with SIGKILL, which cannot be caught. The supervisor handles
SIGTERM as for any launch (the job stops on every node, nothing is left running), so a lost tuner
never leaves a trial training on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from zerorun.errors import ZerorunError

PARENT_POLL_S = 0.5


def watch_parent(parent: int) -> None:
    """SIGTERM to this process as soon as `parent` is no longer its parent (it died; we were re-parented)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="zerorun-tune-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    from zerorun.launch import launcher

    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    watch_parent(int(spec["parent"]))
    fields: dict[str, Any] = {k: tuple(v) if k == "overrides" else v for k, v in spec["options"].items()}
    options = launcher.LaunchOptions(**fields)
    try:
        return launcher.run(launcher.make_plan(spec["recipe"], options))
    except ZerorunError as exc:  # as the CLI reports it: one line, exit status 2
        print(f"zerorun: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
