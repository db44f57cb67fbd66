"""`zerorun report`'s pictures: PNG plots of one job, from the records of its telemetry.jsonl.

    paths = write_plots(records, Path("runs/gpt/plots/<job id>"))

- `loss.png`: loss and tokens/s per step, one line per rank and attempt: a restart is a dotted
  line where the next attempt resumed, and the attempt before it is faded where its steps ran again;
- `memory.png`: each rank's device memory over time (CUDA's allocated bytes, or on CPU what the
  engine holds) with its ZeRO model states (params + grads + master + optimizer) dashed, and its RSS;
- `time.png`: where a step's time goes, per rank, as means over the steps after each rank's first:
  compute, communication the compute did not hide (time blocked in collectives) and I/O (time
  blocked on offload transfers); the time collectives were in flight is written on each bar;
- `offload.png`, when the job offloaded anything: bytes moved per direction and rank.

Drawn with matplotlib's object API (no pyplot, no global backend), only where matplotlib is
installed (the `report` extra); the numbers come from `series`, as in the CSV and TensorBoard files.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from zerorun.telemetry.series import OFFLOAD_DIRECTIONS, offload_bytes, sample_row, step_row

MiB = 2**20


def available() -> bool:
    """Whether matplotlib is installed here (the `report` extra): a launch promises plots only then."""
    import importlib.util

    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # in sys.modules as None: hidden on purpose
        return False


def write_plots(records: list[dict[str, Any]], directory: Path) -> list[Path]:
    """Write the job's PNGs into `directory`; return their paths (none without step records)."""
    from matplotlib.figure import Figure

    steps = _by_rank([step_row(r) | {"_record": r} for r in records if r.get("type") == "step"])
    samples = _by_rank([sample_row(r) for r in records if r.get("type") == "sample"])
    if not steps:
        return []
    job = next((r for r in records if r.get("type") == "job"), {})
    title = f"job {job.get('job_id', '?')}"
    hosts = {r["rank"]: r.get("host", "?") for r in records if r.get("type") == "hello"}
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (("loss", _loss), ("memory", _memory), ("time", _time), ("offload", _offload)):
        fig = Figure(figsize=(9, 6.5), layout="constrained")
        subtitle = draw(fig, steps, samples, hosts, float(job.get("t") or 0.0))
        if subtitle is not None:
            fig.suptitle(f"{title}: {subtitle}")
            path = directory / f"{name}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
    return written


def _by_rank(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if isinstance(row.get("rank"), int):
            out[row["rank"]].append(row)
    return dict(sorted(out.items()))


def _label(rank: int, hosts: dict[int, str]) -> str:
    return f"rank {rank} ({hosts.get(rank, '?')})"


def attempts(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A rank's step rows cut where the step goes back (a restart that resumed from a checkpoint)."""
    out: list[list[dict[str, Any]]] = []
    for row in rows:
        if not out or (row["step"] is not None and out[-1][-1]["step"] is not None and row["step"] <= out[-1][-1]["step"]):
            out.append([])
        out[-1].append(row)
    return out


def _loss(fig: Any, steps: dict, _samples: dict, hosts: dict[int, str], _t0: float) -> str | None:
    subtitle = "loss and throughput per step"
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    restarts: list[int] = []
    for index, (rank, rows) in enumerate(steps.items()):
        runs = attempts(rows)
        for n, run in enumerate(runs):  # each attempt its own line; the steps a restart ran again, faded
            xs = [row["step"] for row in run]
            again = n + 1 < len(runs) and runs[n + 1][0]["step"] is not None
            style = dict(color=f"C{index % 10}", label=_label(rank, hosts) if n == 0 else None)
            for ax, key in ((loss_ax, "loss"), (speed_ax, "tokens_per_s")):
                ax.plot(xs, [row[key] for row in run], **style, alpha=0.35 if again else 1.0)
            if n and index == 0:
                restarts.append(run[0]["step"])
    for n, step in enumerate(restarts, 1):
        for ax in (loss_ax, speed_ax):
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
        loss_ax.annotate(f"restart {n}: resumed at step {step}", (step, 1), xycoords=("data", "axes fraction"),
                         rotation=90, ha="right", va="top", fontsize="small", color="grey")
    if restarts:
        subtitle += f" ({len(restarts)} restart{'s' if len(restarts) > 1 else ''}: earlier attempts faded)"
    loss_ax.set_ylabel("loss")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    loss_ax.legend(fontsize="small")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
    return subtitle


def _memory(fig: Any, _steps: dict, samples: dict, hosts: dict[int, str], t0: float) -> str | None:
    if not samples:
        return None
    subtitle = "memory per rank over time"
    device_ax, rss_ax = fig.subplots(2, 1, sharex=True)
    for index, (rank, rows) in enumerate(samples.items()):
        color = f"C{index % 10}"
        xs = [row["t"] - t0 for row in rows]
        device_ax.plot(xs, [_mib(row["device_bytes"]) for row in rows], color=color, label=_label(rank, hosts))
        device_ax.plot(xs, [_mib(row["model_state_bytes"]) for row in rows], color=color, linestyle="--",
                       label=f"rank {rank}: ZeRO model states")
        rss_ax.plot(xs, [_mib(row["rss"]) for row in rows], color=color, label=_label(rank, hosts))
    device_ax.set_ylabel("device memory, MiB\n(CUDA allocated; on CPU: the engine's)")
    rss_ax.set_ylabel("process RSS, MiB")
    rss_ax.set_xlabel("seconds since the job started")
    device_ax.legend(fontsize="small", ncol=2, loc="best")
    for ax in (device_ax, rss_ax):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return subtitle


def time_split(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean seconds per step after the first: compute, comm (blocked), I/O (offload waits), and comm in flight."""
    if len(rows) < 2:
        return None
    first, last, timed = rows[0], rows[-1], rows[1:]
    count = len(timed)
    step = sum(row["step_time_s"] or 0.0 for row in timed) / count
    comm = ((last["comm_waited_s"] or 0.0) - (first["comm_waited_s"] or 0.0)) / count
    io = ((last["offload_waited_s"] or 0.0) - (first["offload_waited_s"] or 0.0)) / count
    flight = ((last["comm_in_flight_s"] or 0.0) - (first["comm_in_flight_s"] or 0.0)) / count
    return {"step": step, "compute": max(0.0, step - comm - io), "comm": comm, "io": io, "in_flight": flight}


def _time(fig: Any, steps: dict, _samples: dict, hosts: dict[int, str], _t0: float) -> str | None:
    splits = {rank: split for rank, rows in steps.items() if (split := time_split(rows)) is not None}
    if not splits:
        return None
    subtitle = "where a step's time goes (mean per step, after the first)"
    ax = fig.subplots()
    labels = [_label(rank, hosts) for rank in splits]
    bottom = [0.0] * len(splits)
    for part, color, name in (("compute", "C0", "compute"), ("comm", "C1", "communication not hidden by compute"),
                              ("io", "C2", "I/O: waiting for offload transfers")):
        values = [split[part] for split in splits.values()]
        ax.bar(labels, values, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, split in enumerate(splits.values()):
        ax.annotate(f"{split['step'] * 1e3:.0f} ms/step\ncomm in flight {split['in_flight'] * 1e3:.0f} ms",
                    (x, split["step"]), ha="center", va="bottom", fontsize="small")
    ax.set_ylabel("seconds per step")
    ax.set_ylim(top=max(bottom) * 1.5)  # room above the bars for their labels, and above those for the legend
    ax.legend(fontsize="small", loc="upper center", ncol=3)
    return subtitle


def _offload(fig: Any, steps: dict, _samples: dict, hosts: dict[int, str], _t0: float) -> str | None:
    moved = {rank: offload_bytes(rows[-1]["_record"]) for rank, rows in steps.items()}
    if not any(any(directions.values()) for directions in moved.values()):
        return None
    subtitle = "offload traffic over the job"
    ax = fig.subplots()
    width = 0.8 / len(OFFLOAD_DIRECTIONS)
    for d, direction in enumerate(OFFLOAD_DIRECTIONS):
        xs = [r + d * width for r in range(len(moved))]
        ax.bar(xs, [_mib(directions[direction]) for directions in moved.values()], width,
               label=direction.replace("_", " ").replace("d2h", "device to host").replace("h2d", "host to device"))
    ax.set_xticks([r + 0.4 - width / 2 for r in range(len(moved))], [_label(rank, hosts) for rank in moved])
    ax.set_ylabel("MiB moved")
    ax.legend(fontsize="small")
    return subtitle


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / MiB
