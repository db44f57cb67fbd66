"""Where profile windows (profile.py) leave their files, and how the launcher and `zerorun report` say so.

Apart from profile.py because the launcher and the CLI read it without importing torch.
"""

from __future__ import annotations

from pathlib import Path

from zerorun.telemetry import RUNS_DIR

TRACE_SUFFIX = ".trace.json.gz"
MEMORY_SUFFIX = ".memory.pickle"


def profile_dir(name: str | None, job_id: str) -> Path:
    """Where a job's traces go: runs/<name>/profile/<job id>/, relative to the working directory."""
    return Path(RUNS_DIR) / (name or "job") / "profile" / job_id


def written_under(run_dir: Path, job_id: str | None = None) -> list[Path]:
    """The traces and memory snapshots under runs/<name>/profile/ (of one job and its restarts, when given)."""
    root = run_dir / "profile"
    if not root.is_dir():
        return []
    jobs = [d for d in sorted(root.iterdir()) if d.is_dir() and (job_id is None or d.name.startswith(job_id))]
    return [f for d in jobs for f in sorted(d.iterdir()) if f.name.endswith((TRACE_SUFFIX, MEMORY_SUFFIX))]


def describe(files: list[Path]) -> str:
    """One line for the launcher and `zerorun report`: where the traces are and what opens them."""
    if not files:
        return ""
    folders = sorted({str(f.parent) for f in files})
    traces = sum(f.name.endswith(TRACE_SUFFIX) for f in files)
    memory = len(files) - traces
    extra = f" and {memory} CUDA memory snapshot{'s' if memory != 1 else ''} (pytorch.org/memory_viz)" if memory else ""
    return (f"profile: {traces} trace{'s' if traces != 1 else ''} (ui.perfetto.dev or chrome://tracing){extra} "
            f"in {', '.join(folders)}/")


def planned(name: str, job_id: str, start: int, steps: int) -> str:
    """What the launcher says before the job starts, when its recipe asks for a profile."""
    last = start + steps - 1
    which = f"step {start}" if steps == 1 else f"steps {start}-{last}"
    return (f"profile: every rank records optimizer {which} into {profile_dir(name, job_id)}/ (on each node, "
            f"under its working directory)")
