"""`zerorun report runs/<name>`: the end-of-job summary again, and plots, from the run's telemetry.jsonl.

The file may hold several jobs of the same name, one after another (each starts with a `job`
record); the report shows the last one, or the one whose id is given. A job still running (no
`end` record) is shown as far as it got. The plots (`plots.write_plots`) go to
`runs/<name>/plots/<job id>/*.png`, next to the telemetry, where matplotlib is installed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from zerorun.errors import ZerorunError
from zerorun.telemetry import console, profile_files
from zerorun.telemetry.state import RunState

FILE_NAME = "telemetry.jsonl"
_ATTEMPT = re.compile(r"-r\d+$")  # a restarted job's attempt k runs as <job id>-r<k>


def load(path: str | Path, job_id: str | None = None) -> RunState:
    """The state of one job in a run directory (or a telemetry.jsonl file)."""
    state = RunState()
    for record in load_records(path, job_id):
        state.ingest(record, float(record.get("t") or 0.0))
    return state


def load_records(path: str | Path, job_id: str | None = None) -> list[dict[str, Any]]:
    """The records of one job (the last, or `job_id`) in a run directory or a telemetry.jsonl file."""
    path = Path(path)
    file = path / FILE_NAME if path.is_dir() else path
    if not file.is_file():
        raise ZerorunError(f"{path}: no {FILE_NAME} here; give a run directory (runs/<name>) or its {FILE_NAME}.")
    jobs = _split_jobs(file)
    if not jobs:
        raise ZerorunError(f"{file}: no telemetry records in it.")
    if job_id is None:
        records = jobs[-1]
    else:
        matching = [j for j in jobs if j[0].get("job_id") == job_id]
        if not matching:
            known = ", ".join(str(j[0].get("job_id")) for j in jobs)
            raise ZerorunError(f"{file}: no job {job_id}; it holds {known}.")
        records = matching[-1]
    return records


def plot(path: str | Path, job_id: str | None = None) -> str:
    """Write the job's plots next to its telemetry; one line saying where (or why not)."""
    from zerorun.telemetry.plots import write_plots

    records = load_records(path, job_id)
    path = Path(path)
    run_dir = path if path.is_dir() else path.parent
    job = str(records[0].get("job_id") or "job")
    try:
        written = write_plots(records, run_dir / "plots" / job)
    except ModuleNotFoundError as exc:  # write_plots imports matplotlib when it draws
        if (exc.name or "").partition(".")[0] != "matplotlib":
            raise
        return "plots: not written: matplotlib is not installed (pip install 'zerorun[report]')"
    if not written:
        return "plots: none: the job has no step records yet"
    return f"plots: {written[0].parent}/ " + ", ".join(p.name for p in written)


def profiles(path: str | Path, job_id: str | None = None) -> str:
    """The job's profiler traces and memory snapshots (telemetry.profile_start), one line; "" when it has none."""
    records = load_records(path, job_id)
    path = Path(path)
    run_dir = path if path.is_dir() else path.parent
    job = records[0].get("job_id")
    return profile_files.describe(profile_files.written_under(run_dir, job if isinstance(job, str) else None))


def render(state: RunState) -> RenderableType:
    """The summary table, with the stall reports the job had."""
    parts: list[RenderableType] = [console.summary(state)]
    line = console.checkpoint_line(state)
    if line:
        parts.append(Text(line))
    for stall in state.stalls:
        behind = ", ".join(f"rank {r}" for r in stall.get("behind", [])) or "no rank in particular"
        parts.append(Text(f"stall after {stall.get('quiet_s', 0):.0f} s without a step; behind: {behind}"))
    parts += [Text(restart.describe()) for restart in state.restarts]
    return Group(*parts)


def _split_jobs(file: Path) -> list[list[dict[str, Any]]]:
    """The file's records, grouped by job (records before any `job` record form a job of their own).

    A record that carries a `job_id` joins that job (a restart's attempts run as `<id>-r<k>`), wherever
    it is in the file; one without (files from before job ids were written) joins the job above it."""
    jobs: list[list[dict[str, Any]]] = []
    by_id: dict[str, list[dict[str, Any]]] = {}
    with open(file, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # a line cut short by a crash
            if not isinstance(record, dict):
                continue
            job_id = record.get("job_id")
            if record.get("type") == "job" or not jobs:
                jobs.append([])
                if record.get("type") == "job" and isinstance(job_id, str):
                    by_id[job_id] = jobs[-1]
            group = jobs[-1]
            if isinstance(job_id, str) and record.get("type") != "job":
                group = by_id.get(job_id) or by_id.get(_ATTEMPT.sub("", job_id)) or group
            group.append(record)
    return jobs
