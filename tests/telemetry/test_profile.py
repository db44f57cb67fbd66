"""Profiler traces on request (`telemetry.profile_start`/`profile_steps`): every rank's Chrome trace holds
zerorun's phases, a window opens and closes at its steps, the CUDA memory snapshot is taken (a fake stands
in for CUDA here), errors are one warning and never stop training, the launcher and `zerorun report` say
where the files are."""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.harness import run_ranks
from zerorun.cli import app
from zerorun.runtime import ranges
from zerorun.telemetry import profile, profile_files

TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")


class FakeProfiler:
    """torch.profiler's start/stop/export, writing a trace of what it was asked; `fail` names a call that raises."""

    def __init__(self, calls: list[str], fail: str | None = None) -> None:
        self.calls, self.fail = calls, fail

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name} failed")

    def start(self) -> None:
        self._call("start")

    def stop(self) -> None:
        self._call("stop")

    def export_chrome_trace(self, path: str) -> None:
        self._call("export")
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": []}, f)


class FakeMemory:
    """The CUDA allocator's history, as `CudaMemoryHistory` drives it."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def start(self) -> None:
        self.calls.append("memory start")

    def dump(self, path: Path) -> None:
        self.calls.append("memory dump")
        path.write_bytes(b"snapshot")

    def stop(self) -> None:
        self.calls.append("memory stop")


def _window(tmp_path: Path, calls: list[str], fail: str | None = None, memory: bool = True,
            directory: Path | None = None) -> profile.ProfileWindow:
    return profile.ProfileWindow(2, 2, directory or tmp_path / "profile" / "job", 1, lambda: FakeProfiler(calls, fail),
                                 FakeMemory(calls) if memory else None)


def test_a_window_records_its_steps_then_writes_the_trace_and_the_memory_snapshot(tmp_path: Path) -> None:
    calls: list[str] = []
    window = _window(tmp_path, calls)
    seen = []
    for step in range(6):  # the engine at step 0 (initialize), then after each optimizer step
        window.reached(step)
        seen.append((step, window.recording, window.ranges.recording))
    assert seen == [(0, False, False), (1, False, False), (2, True, True), (3, True, True), (4, False, False),
                    (5, False, False)]
    assert calls == ["memory start", "start", "stop", "memory dump", "memory stop", "export"]
    assert [p.name for p in window.written] == ["rank-1.trace.json.gz", "rank-1.memory.pickle"]
    assert all(p.is_file() for p in window.written)


def test_a_resumed_engine_inside_the_window_records_what_is_left_and_a_window_opens_once(tmp_path: Path) -> None:
    calls: list[str] = []
    window = _window(tmp_path, calls, memory=False)
    window.reached(3)  # resumed at step 3: one step of the window is left
    assert window.recording
    window.reached(4)
    window.reached(3)  # a step counter that goes back (a load_checkpoint) does not record again
    assert calls == ["start", "stop", "export"] and not window.recording


@pytest.mark.parametrize("fail", ["start", "stop", "export", "mkdir"])
def test_an_error_is_one_warning_and_the_window_gives_up(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         fail: str) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a directory cannot be made under a file
    calls: list[str] = []
    window = _window(tmp_path, calls, fail=None if fail == "mkdir" else fail,
                     directory=blocked / "profile" if fail == "mkdir" else None)
    with caplog.at_level(logging.WARNING, logger="zerorun"):
        for step in range(8):
            window.reached(step)
        window.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rank 1: profile not" in warnings[0] and "training goes on" in warnings[0], warnings
    assert window.failed and not window.recording and not window.ranges.recording
    assert calls.count("memory start") == calls.count("memory stop")  # the CUDA history never stays on


def _train_profiled(rank: int, world: int, directory: str, overrides: list[str]) -> list[str]:
    """Four steps with telemetry.profile_start=1, profile_steps=2 and a checkpoint saved at step 2."""
    import zerorun
    from tests.runtime.reference import batch, tied_gpt
    from zerorun import config

    os.chdir(directory)  # runs/<name>/profile/local/ lands here
    recipe = config.loads("script: t.py\nname: prof\n", "prof.yaml",
                          ["telemetry.profile_start=1", "telemetry.profile_steps=2", *overrides])
    engine = zerorun.initialize(tied_gpt(0), None, recipe)
    for step in range(4):
        engine.backward(engine(batch(0, rank, step)))
        engine.step()
        if step == 1:
            engine.save_checkpoint(str(Path(directory) / f"ckpt-{'-'.join(overrides)}"), block=True)
    trace = Path("runs/prof/profile/local") / f"rank-{rank}.trace.json.gz"
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith(ranges.PREFIX)})


def test_every_rank_writes_a_chrome_trace_with_zeroruns_phases(tmp_path: Path) -> None:
    stage2 = run_ranks(_train_profiled, 2, (str(tmp_path), ["zero.stage=2", "zero.offload_optimizer=cpu"]))
    phases = {f"zerorun.{name}" for name in ("forward", "backward", "step", "optimizer", "publish", "reduce-scatter",
                                             "reduce-scatter wait", "offload copies", "checkpoint snapshot")}
    assert all(phases <= set(names) for names in stage2), stage2
    stage3 = run_ranks(_train_profiled, 2, (str(tmp_path), ["zero.stage=3", "zero.wrap=[Block]"]))
    assert all({"zerorun.all-gather", "zerorun.all-gather wait", "zerorun.reduce-scatter"} <= set(n) for n in stage3)


@pytest.mark.slow  # a real launch; the development tier keeps the ranks writing their traces
def test_the_launcher_and_report_say_where_each_ranks_trace_is(launch, tmp_path: Path) -> None:
    job = launch(TINY, nproc_per_node=2, train={"steps": 5}, telemetry={"profile_start": 2, "profile_steps": 2})
    assert job.wait() == 0, job.output
    stderr = "\n".join(job.stderr)
    job_dir = next((tmp_path / "runs" / "recipe" / "profile").iterdir())
    assert f"profile: every rank records optimizer steps 2-3 into runs/recipe/profile/{job_dir.name}/" in stderr
    said = f"profile: 2 traces (ui.perfetto.dev or chrome://tracing) in runs/recipe/profile/{job_dir.name}/"
    assert said in stderr, job.output
    for rank in (0, 1):
        with gzip.open(job_dir / f"rank-{rank}.trace.json.gz", "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert {"zerorun.forward", "zerorun.backward", "zerorun.optimizer"} <= names
    report = CliRunner().invoke(app, ["report", str(tmp_path / "runs" / "recipe"), "--no-plots"])
    listed = f"in {tmp_path}/runs/recipe/profile/{job_dir.name}/"
    assert report.exit_code == 0 and listed in report.output, report.output
    assert job.leftovers() == []


def test_the_files_are_described_by_kind() -> None:
    files = [Path("runs/x/profile/j/rank-0.trace.json.gz"), Path("runs/x/profile/j/rank-0.memory.pickle"),
             Path("runs/x/profile/j/rank-1.trace.json.gz")]
    assert profile_files.describe(files) == ("profile: 2 traces (ui.perfetto.dev or chrome://tracing) and 1 CUDA "
                                             "memory snapshot (pytorch.org/memory_viz) in runs/x/profile/j/")
    assert profile_files.describe([]) == ""


def test_a_cuda_engine_records_the_allocators_history_through_torchs_calls(tmp_path: Path, monkeypatch) -> None:
    """On a CPU torch's CUDA calls cannot run: they are replaced by recorders, to check what zerorun asks of them."""
    from types import SimpleNamespace

    from zerorun import config
    from zerorun.runtime import context, events

    asked: list[tuple] = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: asked.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: asked.append(("dump", path)))
    monkeypatch.chdir(tmp_path)
    recipe = config.loads("script: t.py\nname: gpu\n", "gpu.yaml",
                          ["telemetry.profile_start=1", "telemetry.profile_steps=1"])
    engine = SimpleNamespace(recipe=recipe, device=torch.device("cuda", 0), comm=SimpleNamespace(rank=3), global_step=0,
                             runtime=context.Runtime())
    calls: list[str] = []
    window = profile.attach(engine, profiler=lambda: FakeProfiler(calls))
    try:
        for step in (1, 2):
            engine.runtime.events.emit(events.StepStats(step, None, 1.0, 1.0, False, 0, 0.1, 1, 1))
    finally:
        profile.finish(engine.runtime)
    snapshot = "runs/gpu/profile/local/rank-3.memory.pickle"
    assert asked == [("record", {"max_entries": profile.MEMORY_ENTRIES}), ("dump", snapshot),
                     ("record", {"enabled": None})], asked
    assert window is not None and calls == ["start", "stop", "export"]
    assert (tmp_path / "runs/gpu/profile/local/rank-3.trace.json.gz").is_file()
