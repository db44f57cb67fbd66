"""Telemetry records as flat rows: one per step, one per sample, for CSV, TensorBoard and the plots.

The same columns everywhere, so a CSV, a TensorBoard run and `zerorun report`'s PNGs of one job
show the same numbers. Cumulative counters (comm, offload) are kept cumulative here: each reader
takes the differences it needs.
"""

from __future__ import annotations

from typing import Any

from zerorun.telemetry.state import held_bytes, model_state_bytes

STEP_COLUMNS = ("rank", "step", "t", "loss", "lr", "grad_norm", "loss_scale", "skipped", "step_time_s", "samples",
                "tokens", "samples_per_s", "tokens_per_s", "tflops", "mfu", "comm_waited_s", "comm_in_flight_s",
                "comm_bytes", "offload_waited_s", "offload_bytes")
SAMPLE_COLUMNS = ("rank", "t", "rss", "cpu_percent", "device_bytes", "model_state_bytes", "nvme_bytes",
                  "io_read_bytes", "io_write_bytes")
OFFLOAD_DIRECTIONS = ("d2h", "h2d", "nvme_read", "nvme_write")


def step_row(record: dict[str, Any]) -> dict[str, Any]:
    """A `step` record's row (cumulative comm and offload figures summed over their kinds)."""
    comm = record.get("comm") or {}
    offload = record.get("offload") or {}
    row = {key: record.get(key) for key in STEP_COLUMNS if key in record}
    row.update(comm_waited_s=_sum(comm, "waited"), comm_in_flight_s=_sum(comm, "seconds"),
               comm_bytes=_sum(comm, "bytes"), offload_waited_s=float((offload.get("wait") or {}).get("seconds", 0.0)),
               offload_bytes=sum(float((offload.get(d) or {}).get("bytes", 0.0)) for d in OFFLOAD_DIRECTIONS))
    return {key: row.get(key) for key in STEP_COLUMNS}


def sample_row(record: dict[str, Any]) -> dict[str, Any]:
    """A `sample` record's row: device bytes are CUDA's allocated, or on CPU what the engine holds."""
    memory = record.get("memory")
    cuda = record.get("cuda")
    io = record.get("io") or {}
    device = cuda.get("allocated") if cuda else (held_bytes(memory) if memory else None)
    return {"rank": record.get("rank"), "t": record.get("t"), "rss": record.get("rss"),
            "cpu_percent": record.get("cpu_percent"), "device_bytes": device,
            "model_state_bytes": model_state_bytes(memory),
            "nvme_bytes": sum(p.get("nvme", 0) for p in memory.values()) if memory else None,
            "io_read_bytes": io.get("read_bytes"), "io_write_bytes": io.get("write_bytes")}


def offload_bytes(record: dict[str, Any]) -> dict[str, float]:
    """Cumulative offload bytes per direction of a `step` record."""
    offload = record.get("offload") or {}
    return {d: float((offload.get(d) or {}).get("bytes", 0.0)) for d in OFFLOAD_DIRECTIONS}


def _sum(counters: dict[str, dict[str, float]], key: str) -> float:
    return sum(float(kind.get(key, 0.0)) for kind in counters.values())
