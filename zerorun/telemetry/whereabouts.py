"""Where a rank's training thread is: the innermost frame of its stack, or of an exception it raised, and
whether that stack waits in a collective (for other ranks). The probe sends it with every sample, so that
the launcher can tell a rank that hangs in its own code from one that waits for a peer.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# A training thread whose stack passes through these is waiting for other ranks.
# (every module of zerorun's comm/: a wait can sit in collectives.py, handles.py or a codec thread's module)
_COLLECTIVE_FILES = (os.sep + os.path.join("torch", "distributed") + os.sep,
                     os.sep + os.path.join("zerorun", "runtime", "comm") + os.sep)


def where(thread_id: int | None) -> dict[str, Any] | None:
    """The innermost Python frame of a thread, and whether its stack waits in a collective."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return None
    spot = {"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": frame.f_code.co_name}
    in_collective = False
    while frame is not None and not in_collective:
        in_collective = in_collective_file(frame.f_code.co_filename)
        frame = frame.f_back
    return dict(spot, in_collective=in_collective)


def where_raised(exc: BaseException) -> dict[str, Any] | None:
    """Where `exc` was raised (its traceback's innermost frame), and whether it came out of a collective."""
    tb = exc.__traceback__
    if tb is None:
        return None
    in_collective = False
    while tb.tb_next is not None:
        in_collective = in_collective or in_collective_file(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return {"file": code.co_filename, "line": tb.tb_lineno, "function": code.co_name,
            "in_collective": in_collective or in_collective_file(code.co_filename)}


def in_collective_file(filename: str) -> bool:
    return any(part in filename for part in _COLLECTIVE_FILES)


def last_collective(engine: Any) -> str | None:
    """Where the engine's latest collective was issued (runtime/engine_place.py; the stall report names it), or None:
    no engine, none issued yet, or an engine that does not say."""
    try:
        return engine.where.last_collective() if engine is not None else None
    except Exception:  # noqa: BLE001 - telemetry must never break training
        return None
