"""What a worker may send the launcher: one schema per record type, checked before anything reads a record.

The collector trusts a connection only once it proved the job's token (`collector`), and even
then reads nothing it has not checked here: a record of an unknown type, with a field of the
wrong type, a rank outside the world, a string or a mapping past its bound, is dropped (the
collector counts it and the launcher warns once) instead of reaching `RunState`, the file and
the sinks. Fields a schema does not name pass as they are (a newer worker may send more); the
line-length limit bounds them.

To add a record type, add one entry to `SCHEMAS`: field name -> check. A check takes the value
and returns a problem ('' when fine). `FLAT` accepts any fields of plain scalars (a record whose
fields are still settling, such as the checkpoint saves').

The launcher's own records (`job`, `stall`, `end`, `restart`) never come from a worker: a worker
line of those types is dropped too.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any], str]

MAX_TEXT = 4096  # characters in a string field (a file path, a device name)
MAX_ITEMS = 256  # entries in a mapping field (collective kinds, memory kinds and places)
MAX_COUNT = 2**62  # an integer field's bound (bytes, steps, pids)


def prove(token: str, challenge: str) -> str:
    """A worker's answer to the collector's challenge: HMAC-SHA256 of it under the job's token."""
    return hmac.new(token.encode(), challenge.encode(), hashlib.sha256).hexdigest()


def number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number, got {type(value).__name__}"
    if isinstance(value, float) and not math.isfinite(value):
        return "expected a finite number"
    return "" if abs(value) <= MAX_COUNT else "out of range"


def count(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected an integer, got {type(value).__name__}"
    return "" if 0 <= value <= MAX_COUNT else "out of range"


def text(value: Any) -> str:
    if not isinstance(value, str):
        return f"expected a string, got {type(value).__name__}"
    return "" if len(value) <= MAX_TEXT else f"longer than {MAX_TEXT} characters"


def flag(value: Any) -> str:
    return "" if isinstance(value, bool) else f"expected true or false, got {type(value).__name__}"


def optional(check: Check) -> Check:
    return lambda value: "" if value is None else check(value)


def mapping(values: Check) -> Check:
    """A JSON object of at most MAX_ITEMS string keys whose values pass `values`."""
    def check(value: Any) -> str:
        if not isinstance(value, dict):
            return f"expected a mapping, got {type(value).__name__}"
        if len(value) > MAX_ITEMS:
            return f"more than {MAX_ITEMS} entries"
        for key, item in value.items():
            problem = text(key) or values(item)
            if problem:
                return f"{key}: {problem}"
        return ""
    return check


def fields(schema: Mapping[str, Check]) -> Check:
    """A JSON object whose named fields (when present) pass their checks."""
    def check(value: Any) -> str:
        if not isinstance(value, dict):
            return f"expected a mapping, got {type(value).__name__}"
        for key, field_check in schema.items():
            if key in value:
                problem = field_check(value[key])
                if problem:
                    return f"{key}: {problem}"
        return ""
    return check


def scalar(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return ""
    return text(value) if isinstance(value, str) else number(value)


FLAT: Mapping[str, Check] = {}  # no named fields: every field must be a scalar (see `check`)
_COUNTERS = mapping(mapping(number))  # comm, offload: kind -> {bytes, calls, seconds, waited}

SCHEMAS: dict[str, Mapping[str, Check]] = {
    "hello": {"host": text, "pid": count, "pid_start": number, "local_rank": count, "device": optional(text)},
    "engine": {"params": count, "stage": optional(count), "dtype": text, "device_name": optional(text),
               "peak_tflops": optional(number), "flops_per_token": optional(number),
               "flops_per_sample": optional(number), "global_step": count, "resumed_from": optional(text),
               "total_steps": optional(count)},
    "step": {"step": count, "loss": optional(number), "grad_norm": optional(number), "loss_scale": optional(number),
             "skipped": flag, "skipped_total": count, "step_time_s": number, "samples": optional(count),
             "tokens": optional(count), "samples_per_s": optional(number), "tokens_per_s": optional(number),
             "flops": optional(number), "tflops": optional(number), "mfu": optional(number),
             "comm": optional(_COUNTERS), "offload": optional(_COUNTERS), "kernel_build_s": optional(number)},
    "sample": {"rss": optional(count), "cpu_percent": optional(number), "io": optional(mapping(count)),
               "cuda": optional(mapping(count)), "memory": optional(mapping(mapping(count))),
               "where": optional(fields({"file": text, "line": optional(count), "function": text,
                                         "in_collective": flag, "collective": optional(text)})),
               "dropped": optional(count)},
    "bye": {},
    "checkpoint": FLAT,
}
REQUIRED = {"step": ("step",)}  # beyond type, rank and t, which every worker record has


def check(record: Any, world_size: int | None) -> str:
    """Why a worker's record must be dropped ('' when it may be read): type, rank, fields, bounds."""
    if not isinstance(record, dict):
        return "not a JSON object"
    kind = record.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        return f"unknown record type {str(kind)[:40]!r}"
    rank = record.get("rank")
    if count(rank) or (world_size and rank >= world_size):
        return f"{kind}: rank {str(rank)[:40]} is not a rank of this job (world size {world_size})"
    problem = number(record.get("t"))
    if problem:
        return f"{kind}: t: {problem}"
    missing = [key for key in REQUIRED.get(kind, ()) if key not in record]
    if missing:
        return f"{kind}: {', '.join(missing)} missing"
    if schema is FLAT:
        bad = next((key for key, value in record.items() if scalar(value)), None)
        return f"{kind}: {bad}: expected a plain value" if bad is not None else ""
    problem = fields(schema)(record)
    return f"{kind}: {problem}" if problem else ""
