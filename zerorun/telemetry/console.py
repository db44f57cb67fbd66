"""What the launcher shows: pure rendering of a `RunState` into rich renderables and plain lines.

- `live_view`: a progress bar over the steps the script runs (the recipe's `train.steps`, or what an
  engine driven by its script's own loop says; no bar, percentage or ETA where no total is known), with ETA, and a
  table with one row per rank
  (host, rank, step, loss, step time, tokens/s, TFLOP/s, MFU, device memory now/peak, CPU RSS,
  disk GB/s) and a totals row. On a terminal it sits under the workers' scrolling output.
- `summary_line`: the same in one line, printed now and then when the output is not a terminal.
- `summary`: the end-of-job summary (also `zerorun report`): `summary_table` (mean throughput, peak
  memory per rank, skipped steps, time in communication, bytes of block-device I/O), then, after a
  job that offloaded, `offload_table` (bytes and GB/s per direction, and the time steps waited on it).
  Both fit `SUMMARY_WIDTH` columns with nothing cut (a long host name wraps in its cell): as one
  table of 13 columns, the offload text pushed it past 200 columns and rich cut every cell to "…".

Columns in words: "device" memory is CUDA's allocated bytes (peak: `max_memory_allocated`) or, on
CPU, the bytes `engine.memory()` reports (peak: the highest sample); "disk GB/s" is the rank's
block-device I/O rate (NVMe offload, checkpoint writes, anything else the process reads or
writes); "comm" is the host time collectives spent in flight, launch to `wait()` (and its share
of the time in steps), which overlaps compute when overlap works, so it is not time lost.
"""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from zerorun import tables
from zerorun.telemetry.state import RankState, RunState

_LIVE_COLUMNS = ("host", "rank", "step", "loss", "step time", "tokens/s", "TFLOP/s", "MFU", "device now / peak",
                 "CPU RSS", "disk GB/s")
_SUMMARY_COLUMNS = ("host", "rank", "steps", "samples/s", "tokens/s", "TFLOP/s", "MFU", "peak device", "peak RSS",
                    "skipped", "comm", "I/O")
SUMMARY_WIDTH = tables.WIDTH  # the summary's width where no terminal says otherwise (logs, CI, `zerorun report | less`)


def live_view(state: RunState, now: float | None = None) -> RenderableType:
    """Progress bar and per-rank table."""
    now = time.time() if now is None else now
    line = checkpoint_line(state)
    return Group(progress(state, now), rank_table(state), *([Text(line)] if line else []))


def checkpoint_line(state: RunState) -> str | None:
    """The job's checkpoints: how many, the latest one's stall, write time and bytes (slowest rank's
    times, all ranks' bytes), and the training time they cost in all (the rank that waited longest)."""
    ranks = [r for r in state.sorted_ranks() if r.checkpoint_last is not None]
    if not ranks:
        return None
    last = max(r.checkpoint_last["step"] for r in ranks)
    latest = [r.checkpoint_last for r in ranks if r.checkpoint_last["step"] == last]
    modes = sorted({str(c.get("mode")) for c in latest})
    return (f"checkpoints: {max(r.checkpoints for r in ranks)} saved; {latest[0].get('tag')} ({', '.join(modes)}): "
            f"training waited {seconds(max(c['stall_s'] for c in latest))}, written in "
            f"{seconds(max(c['write_s'] for c in latest))}, {nbytes(sum(c['bytes'] for c in latest))}; "
            f"training waited {seconds(max(r.checkpoint_stall_s for r in ranks))} for all of them")


def progress(state: RunState, now: float) -> RenderableType:
    total = state.total_steps
    step = state.step
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    if total:
        grid.add_column(width=40)
    grid.add_column(no_wrap=True)
    timing = f"elapsed {duration(state.elapsed_s(now))}"
    if total:
        timing = f"{_percent(step, total)}  {timing}  ETA {duration(state.eta_s(now))}"
    quiet = now - state.last_step_at if state.last_step_at is not None else None
    if quiet is not None and quiet >= 10 and (total is None or step < total):
        timing += f"  [no step for {quiet:.0f} s]"
    if state.restarts:
        timing += f"  [restart {len(state.restarts)}]"
    bar = [ProgressBar(total=total, completed=min(step, total), width=40)] if total else []
    grid.add_row(Text(f"step {_of_total(step, total)}", style="bold"), *bar, Text(timing))
    return grid


def _of_total(step: int, total: int | None) -> str:
    """`42/60`, or `42` where the script's total is not known."""
    return f"{step}/{total}" if total else str(step)


def rank_table(state: RunState) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 1))
    for i, name in enumerate(_LIVE_COLUMNS):
        table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
    ranks = state.sorted_ranks()
    for r in ranks:
        table.add_row(r.host, str(r.rank), str(r.step), _loss(r.loss), seconds(r.step_time_s), _count(r.tokens_per_s),
                      _flops(r.tflops), _mfu(r.mfu), f"{nbytes(r.device_now)} / {nbytes(r.device_peak or None)}",
                      nbytes(r.rss), _gbps(r.io_rate))
    if len(ranks) > 1:
        t = totals(ranks)
        table.add_row("all", "", str(state.step), _loss(t["loss"]), seconds(t["step_time_s"]),
                      _count(t["tokens_per_s"]), _flops(t["tflops"]), _mfu(t["mfu"]),
                      f"{nbytes(t['device_now'])} / {nbytes(t['device_peak'])}", nbytes(t["rss"]),
                      _gbps(t["io_rate"]), style="bold")
    return table


def totals(ranks: list[RankState]) -> dict[str, float | None]:
    """Across ranks: mean loss, slowest step, summed throughput and memory."""
    total = _sum
    losses = [r.loss for r in ranks if r.loss is not None]
    tflops = total([r.tflops for r in ranks])
    peak = total([r.peak_tflops for r in ranks if r.tflops is not None])
    return {
        "loss": sum(losses) / len(losses) if losses else None,
        "step_time_s": max((r.step_time_s for r in ranks if r.step_time_s is not None), default=None),
        "tokens_per_s": total([r.tokens_per_s for r in ranks]),
        "tflops": tflops,
        "mfu": tflops / peak if tflops is not None and peak else None,
        "device_now": total([r.device_now for r in ranks]),
        "device_peak": total([r.device_peak or None for r in ranks]),
        "rss": total([r.rss for r in ranks]),
        "io_rate": total([r.io_rate for r in ranks]),
    }


def summary_line(state: RunState, now: float | None = None) -> str:
    """One plain line for logs: progress, then the totals of the table."""
    now = time.time() if now is None else now
    t = totals(state.sorted_ranks())
    total = state.total_steps
    progress_text = (f"step {state.step}/{total} ({_percent(state.step, total)}) elapsed "
                     f"{duration(state.elapsed_s(now))} ETA {duration(state.eta_s(now))}") if total else \
        f"step {state.step} elapsed {duration(state.elapsed_s(now))}"
    parts = [progress_text,
             f"loss {_loss(t['loss'])}", f"step {seconds(t['step_time_s'])}",
             f"{_count(t['tokens_per_s'])} tokens/s", f"{_flops(t['tflops'])} TFLOP/s (MFU {_mfu(t['mfu'])})",
             f"device {nbytes(t['device_now'])} (peak {nbytes(t['device_peak'])})", f"RSS {nbytes(t['rss'])}",
             f"disk {_gbps(t['io_rate'])} GB/s"]
    return " | ".join(parts)


def summary(state: RunState) -> RenderableType:
    """The end-of-job summary: a title line, the per-rank table and what its columns mean, then the
    offload table after a job that offloaded. The lines of text wrap at the console's width, not the
    tables' (a rich table title wraps at the table's own width)."""
    parts: list[RenderableType] = [Text(summary_title(state)), summary_table(state), Text(_SUMMARY_CAPTION)]
    offload = offload_table(state)
    if offload is not None:
        parts += [Text("offload: bytes moved @ GB/s, per direction; waited: the time steps waited on it"), offload]
    overlap = overlap_line(state)
    if overlap is not None:
        parts.append(Text(overlap))
    return Group(*parts)


def overlap_line(state: RunState) -> str | None:
    """What `zero.overlap_optimizer` did, where it ran (optim/overlap.py's telemetry): steps applied as made under the
    backward and rolled back (why), and the host update time it hid (run under the backward, not waited for), summed
    over the ranks."""
    ranks = [r.offload["overlap"] for r in state.sorted_ranks() if r.offload.get("overlap")]
    if not ranks:
        return None
    applied, rolled_back = int(ranks[0].get("applied", 0)), int(ranks[0].get("rolled_back", 0))  # the same on each rank
    ran = sum(float(r.get("seconds", 0.0)) for r in ranks)
    waited = sum(float(r.get("waited", 0.0)) for r in ranks)
    reasons: dict[str, float] = {}
    for r in state.sorted_ranks():
        for reason, n in (r.offload.get("overlap_rollbacks") or {}).items():
            reasons[reason] = max(reasons.get(reason, 0.0), n)
    why = f" ({', '.join(f'{reason} {int(n)}' for reason, n in sorted(reasons.items()))})" if reasons else ""
    return (f"host optimizer under the backward (zero.overlap_optimizer): {applied} step(s) applied as made, "
            f"{rolled_back} rolled back and run again{why}; {seconds(ran)} of host updates over {len(ranks)} rank(s), "
            f"{seconds(max(ran - waited, 0.0))} of it hidden under the backward ({seconds(waited)} waited for)")


_SUMMARY_CAPTION = ("means over the steps after each rank's first; all: sums (max for skipped, comm). comm: time "
                    "blocked waiting for collectives (the share of step time compute did not hide)")


def summary_title(state: RunState) -> str:
    """`job ID: 60/60 steps in 0:00:14, exit code 0` (and stall reports, restarts)."""
    title = f"job {state.job.get('job_id', '?')}: {steps_done(state)} in " \
            f"{duration(state.elapsed_s(state.ended_at or time.time()))}"
    if state.exit_code is not None:
        title += f", exit code {state.exit_code}"
    if state.stalls:
        title += f", {len(state.stalls)} stall report{'s' if len(state.stalls) != 1 else ''}"
    if state.restarts:
        title += f", {len(state.restarts)} restart{'s' if len(state.restarts) != 1 else ''} (below)"
    return title


def _columns(table: Table, names: tuple[str, ...]) -> None:
    """Left-aligned host (wrapping when a name is long: never cut), right-aligned figures that never wrap."""
    for i, name in enumerate(names):
        if i == 0:
            table.add_column(name, justify="left", overflow="fold")
        else:
            table.add_column(name, justify="right", no_wrap=True)


def summary_table(state: RunState) -> Table:
    """The end-of-job table, one row per rank and a totals row."""
    table = tables.compact()
    _columns(table, _SUMMARY_COLUMNS)
    ranks = state.sorted_ranks()
    for r in ranks:
        table.add_row(r.host, str(r.rank), str(r.step), _count(r.mean(r.timed_samples), 1),
                      _count(r.mean(r.timed_tokens)), _flops(_tflops_mean(r)), _mfu(_mfu_mean(r)),
                      nbytes(r.device_peak or None), nbytes(r.rss_peak or None), str(r.skipped_total),
                      _comm(r.comm_waited_s, r.timed_s), nbytes(r.io_bytes))
    if len(ranks) > 1:
        total = _sum
        tflops = total([_tflops_mean(r) for r in ranks])
        peak = total([r.peak_tflops for r in ranks if _tflops_mean(r) is not None])
        table.add_row("all", "", str(state.step), _count(total([r.mean(r.timed_samples) for r in ranks]), 1),
                      _count(total([r.mean(r.timed_tokens) for r in ranks])), _flops(tflops),
                      _mfu(tflops / peak if tflops is not None and peak else None),
                      nbytes(total([r.device_peak or None for r in ranks])),
                      nbytes(total([r.rss_peak or None for r in ranks])),
                      str(max(r.skipped_total for r in ranks)),
                      _comm(max((r.comm_waited_s or 0.0) for r in ranks) if any(r.comm_waited_s is not None
                                                                                 for r in ranks) else None,
                            max(r.timed_s for r in ranks)),
                      nbytes(sum(r.io_bytes for r in ranks)), style="bold")
    return table


def offload_table(state: RunState) -> Table | None:
    """Offload traffic per rank: bytes and GB/s per direction, and the time steps waited on it; None when
    no rank moved any (only the directions some rank used get a column)."""
    ranks = [r for r in state.sorted_ranks() if any(r.offload.get(key, {}).get("bytes") for key, _ in _DIRECTIONS)]
    if not ranks:
        return None
    used = [(key, label) for key, label in _DIRECTIONS if any(r.offload.get(key, {}).get("bytes") for r in ranks)]
    table = tables.compact()
    _columns(table, ("host", "rank", *(label for _, label in used), "waited"))
    for r in ranks:
        table.add_row(r.host, str(r.rank), *(_direction(r.offload.get(key)) for key, _ in used),
                      seconds(r.offload.get("wait", {}).get("seconds", 0.0)))
    return table


def _direction(entry: dict[str, float] | None) -> str:
    if not entry or not entry.get("bytes"):
        return "-"
    rate = entry["bytes"] / entry["seconds"] if entry.get("seconds") else None
    return f"{nbytes(entry['bytes'])} @ {_gbps(rate)}"


def _sum(values: list[float | None]) -> float | None:
    """The sum of the values present; None when none is."""
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _tflops_mean(r: RankState) -> float | None:
    return r.timed_flops / r.timed_s / 1e12 if r.timed_flops and r.timed_s > 0 else None


def _mfu_mean(r: RankState) -> float | None:
    tflops = _tflops_mean(r)
    return tflops / r.peak_tflops if tflops is not None and r.peak_tflops else None


def _comm(waited_s: float | None, timed_s: float) -> str:
    """Seconds blocked in collectives over the timed steps, and their share of those steps' time."""
    if waited_s is None:
        return "-"
    share = f" ({100 * waited_s / timed_s:.0f}%)" if timed_s > 0 else ""
    return f"{waited_s:.2f} s{share}"


def steps_done(state: RunState) -> str:
    """`60/60 steps`, or after a resume `steps 41-60 of 60 (20 run, resumed after step 40)`; without a
    known total (a script that drives its own loop) `10 steps`, `steps 41-60 (...)`."""
    first, total = state.first_step, state.total_steps
    of = f" of {total}" if total else ""
    if first is None or first <= 1:
        return f"{_of_total(state.step, total)} step{'s' if total or state.step != 1 else ''}"
    if state.step < first:  # resumed, and no step since has reached the telemetry
        return f"resumed after step {first - 1}{of}; no step since reported"
    return f"steps {first}-{state.step}{of} ({state.step - first + 1} run, resumed after step {first - 1})"


_DIRECTIONS = (("d2h", "D2H"), ("h2d", "H2D"), ("nvme_read", "NVMe read"), ("nvme_write", "NVMe write"))


# -- formatting ------------------------------------------------------------------------------------


def nbytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def duration(s: float | None) -> str:
    if s is None:
        return "-:--:--"
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _percent(step: int, total: int | None) -> str:
    return f"{100 * step / total:.0f}%" if total else "-"


def _count(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _loss(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _flops(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _mfu(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _gbps(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{bytes_per_s / 1e9:.2f}"
