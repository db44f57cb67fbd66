"""State folding and rendering from synthetic records, without processes: live table, plain line,
summary, `zerorun report`, which ranks are behind, FLOPs and device peaks."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

from zerorun.cli import app
from zerorun.errors import ZerorunError
from zerorun.telemetry import console, report
from zerorun.telemetry.flops import count_training_flops, peak_tflops
from zerorun.telemetry.state import RunState

MiB = 2**20


def job_records(job_id: str = "demo-1", steps: int = 4, ranks: int = 2) -> list[dict]:
    """A finished 2-rank job on one CUDA host: hello, engine, steps 1..steps, a sample per step, bye, end."""
    out: list[dict] = [{"type": "job", "job_id": job_id, "name": "demo", "world_size": ranks, "steps": 10,
                        "t": 100.0}]
    for r in range(ranks):
        out.append({"type": "hello", "rank": r, "t": 101.0, "host": "gpu-node", "pid": 1000 + r, "pid_start": 99.0})
        out.append({"type": "engine", "rank": r, "t": 102.0, "params": 1_000_000_000, "peak_tflops": 989.0})
    for step in range(1, steps + 1):
        for r in range(ranks):
            seconds = 2.0 if step == 1 else 0.5  # the first step is slow (start-up) and left out of means
            out.append({"type": "step", "rank": r, "t": 102.0 + step, "step": step, "loss": 3.0 - 0.1 * step - r / 100,
                        "grad_norm": 1.0, "loss_scale": 1.0, "skipped": False, "skipped_total": 0,
                        "step_time_s": seconds, "samples": 8, "tokens": 8192, "samples_per_s": 8 / seconds,
                        "tokens_per_s": 8192 / seconds, "flops": 6e9 * 8192, "tflops": 6e9 * 8192 / seconds / 1e12,
                        "mfu": 6e9 * 8192 / seconds / 1e12 / 989.0,
                        "comm": {"reduce_scatter": {"bytes": 4e9 * step, "calls": 10 * step, "seconds": 0.1 * step,
                                                    "waited": 0.05 * step}}})
            out.append({"type": "sample", "rank": r, "t": 102.0 + step, "rss": (3000 + step) * MiB, "cpu_percent": 99.0,
                        "cuda": {"allocated": 20_000 * MiB, "reserved": 30_000 * MiB, "peak": (24_000 + step) * MiB},
                        "memory": {"params": {"cuda": 2 * 10**9}, "optimizer": {"nvme": 12 * 10**9}},
                        "io": {"read_bytes": step * 10**9, "write_bytes": step * 10**9},
                        "where": {"file": "/x/train.py", "line": 7, "function": "main", "in_collective": False}})
    out += [{"type": "bye", "rank": r, "t": 110.0} for r in range(ranks)]
    out.append({"type": "end", "exit_code": 0, "t": 111.0})
    return out


def fold(records: list[dict]) -> RunState:
    state = RunState()
    for record in records:
        state.ingest(record, record["t"])
    return state


def text(renderable, width: int = 200) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(renderable)
    return buffer.getvalue()


def test_state_keeps_latest_figures_and_means_without_the_first_step_and_ignores_repeats():
    records = job_records()
    records.insert(12, dict(records[10]))  # a step record sent twice across a reconnect
    state = fold(records)
    rank = state.ranks[1]
    assert (state.step, state.total_steps, rank.host, rank.finished) == (4, 10, "gpu-node", True)
    assert rank.loss == pytest.approx(2.6 - 0.01)
    assert rank.steps_seen == 4 and rank.timed_s == pytest.approx(1.5)  # steps 2-4
    assert rank.mean(rank.timed_tokens) == pytest.approx(8192 / 0.5)
    assert rank.device_peak == 24_004 * MiB and rank.rss_peak == 3004 * MiB and rank.nvme_bytes == 12 * 10**9
    assert rank.io_rate == pytest.approx(2e9) and rank.io_bytes == 6 * 10**9
    assert rank.first_step == 1
    assert rank.comm_waited_s == pytest.approx(0.15) and rank.comm_in_flight_s == pytest.approx(0.3)  # steps 2-4


def test_live_view_has_a_progress_bar_a_row_per_rank_and_totals():
    state = fold(job_records()[:-4])  # still running: no bye, no end
    shown = text(console.live_view(state, now=107.0))
    assert "step 4/10" in shown and "40%" in shown
    assert "ETA 0:00:02" in shown  # 6 steps x 0.5 s, less the 1 s since the last one
    rows = [line.split() for line in shown.splitlines() if line.startswith(("gpu-node", "all"))]
    assert [row[:3] for row in rows] == [["gpu-node", "0", "4"], ["gpu-node", "1", "4"], ["all", "4", "2.5950"]]
    assert rows[0][3:] == ["2.6000", "500", "ms", "16,384", "98.3", "9.9%", "19.5", "GiB", "/", "23.4", "GiB",
                           "2.9", "GiB", "2.00"]
    assert "32,768" in rows[2] and "196.6" in rows[2]  # totals: summed tokens/s and TFLOP/s


def test_plain_summary_line_says_progress_and_totals_in_one_line():
    line = console.summary_line(fold(job_records()[:-4]), now=107.0)
    assert line.startswith("step 4/10 (40%) elapsed 0:00:07 ETA 0:00:02 | loss 2.5950 | step 500 ms")
    assert "32,768 tokens/s" in line and "196.6 TFLOP/s (MFU 9.9%)" in line and "disk 4.00 GB/s" in line
    assert "\n" not in line


def test_summary_table_shows_mean_throughput_peaks_skips_and_comm_per_rank():
    shown = text(console.summary(fold(job_records())))
    assert "job demo-1: 4/10 steps in 0:00:11, exit code 0" in shown
    row = next(line for line in shown.splitlines() if "gpu-node" in line and " 0 " in line)
    for figure in ("16.0", "16,384", "98.3", "9.9%", "23.4 GiB", "2.9 GiB", "0.15 s (10%)", "5.6 GiB"):
        assert figure in row, (figure, row)


def test_comm_is_the_time_blocked_in_collectives_so_its_share_of_step_time_never_exceeds_100_percent():
    records = job_records()
    for r in records:  # several reduce-scatters in flight at once: 3 s "in flight" per 0.5 s step
        if r["type"] == "step":
            r["comm"]["reduce_scatter"]["seconds"] = 3.0 * r["step"]
    state = fold(records)
    assert state.ranks[0].comm_in_flight_s == pytest.approx(9.0)  # 600% of the 1.5 s of timed steps
    row = next(line for line in text(console.summary(state)).splitlines() if "gpu-node" in line)
    assert "0.15 s (10%)" in row and "600%" not in row


def test_after_a_resume_the_summary_counts_the_steps_this_job_ran():
    records = [r for r in job_records(steps=4) if r.get("type") != "step" or r["step"] > 2]
    shown = text(console.summary(fold(records)))
    assert "job demo-1: steps 3-4 of 10 (2 run, resumed after step 2) in" in shown


def test_model_state_kinds_are_the_runtimes():
    from zerorun.runtime.memory import MODEL_STATE_KINDS
    from zerorun.telemetry import state

    assert state.MODEL_STATE_KINDS == MODEL_STATE_KINDS
    assert state.model_state_bytes({"params": {"cuda": 2}, "optimizer": {"nvme": 3}, "buffers": {"cuda": 5}}) == 5


def test_the_culprit_is_the_rank_outside_a_collective_or_the_one_that_went_silent():
    state = fold(job_records()[:-4])
    waiting = {"function": "wait", "file": "collectives.py", "line": 62, "in_collective": True}
    state.ranks[0].where = waiting
    culprit = state.culprit(0)
    assert (culprit.rank, culprit.host) == (1, "gpu-node")
    assert culprit.why == "stopped making progress at step 4, in main (train.py:7)"
    assert culprit.evidence[0] == "rank 0 on gpu-node: step 4, in wait (collectives.py:62), waiting in a collective"
    state.ranks[1].where = dict(waiting)
    assert state.culprit(0) is None  # both waited: nothing to tell
    state.ranks[1].last_sample_at = state.ranks[0].last_sample_at - 20  # rank 1 stopped sending (SIGSTOP)
    assert state.culprit(0).why.startswith("stopped answering (no telemetry for 20 s: stopped or frozen)")
    state.ranks[0].where = {"function": "main", "file": "train.py", "line": 3, "in_collective": False}
    assert state.culprit(0) is None  # rank 0 failed on its own, not waiting for anyone


def test_behind_is_the_lowest_step_or_at_equal_steps_the_ranks_outside_a_collective():
    state = fold(job_records()[:-4])
    state.ranks[0].step = 3
    behind, waiting = state.behind()
    assert [r.rank for r in behind] == [0] and [r.rank for r in waiting] == [1]
    state.ranks[0].step = 4
    state.ranks[0].where = {"function": "wait", "file": "collectives.py", "line": 62, "in_collective": True}
    behind, waiting = state.behind()
    assert [r.rank for r in behind] == [1] and [r.rank for r in waiting] == [0]
    assert behind[0].describe_where() == "in main (train.py:7)"
    state.ranks[1].where = dict(state.ranks[0].where)
    assert state.behind() == ([], [state.ranks[0], state.ranks[1]])  # everyone waits: no culprit to name


def test_report_shows_the_last_job_of_a_run_directory_or_the_one_asked_for(tmp_path: Path):
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    lines = job_records("first", steps=2) + job_records("second", steps=3)
    (run / "telemetry.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n{\"cut short")
    assert report.load(run).job["job_id"] == "second" and report.load(run).step == 3
    assert report.load(run / "telemetry.jsonl", job_id="first").step == 2
    with pytest.raises(ZerorunError, match="no job third; it holds first, second"):
        report.load(run, job_id="third")
    with pytest.raises(ZerorunError, match="no telemetry.jsonl here"):
        report.load(tmp_path)

    result = CliRunner().invoke(app, ["report", str(run)])
    assert result.exit_code == 0 and "job second: 3/10 steps" in result.output
    result = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "no telemetry.jsonl" in result.output


@pytest.mark.parametrize(("name", "dtype", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H200", "fp16", 989.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("NVIDIA A10G", "bf16", 70.0), ("NVIDIA L4", "bf16", 121.0),
    ("Some future GPU", "bf16", None), (None, "bf16", None)])
def test_device_peaks_come_from_the_name_and_dtype(name, dtype, peak):
    assert peak_tflops(name, dtype) == peak


def test_measured_training_flops_are_three_forwards():
    assert count_training_flops(nn.Linear(16, 8), torch.randn(4, 16)) == 3 * 2 * 4 * 16 * 8


def _offloaded(host: str = "gpu-node", big: bool = False) -> list[dict]:
    """`job_records` whose ranks moved D2H and NVMe-read bytes (every direction, in hundreds of GiB, when `big`)."""
    records = job_records(ranks=3 if big else 2)
    directions = ("d2h", "h2d", "nvme_read", "nvme_write") if big else ("d2h", "nvme_read")
    for r in records:
        if r["type"] == "hello":
            r["host"] = host
        if r["type"] == "step":
            scale, seconds = (123.4 * 2**30, 10.0) if big else (2**30, 0.25)
            r["offload"] = {key: {"bytes": scale * r["step"] / (1 if big else 1 + i), "seconds": seconds * r["step"]}
                            for i, key in enumerate(directions)}
            r["offload"]["wait"] = {"bytes": 0, "seconds": (12.5 if big else 0.0625) * r["step"]}
    return records


def test_offload_table_shows_bytes_and_rate_per_direction_used_and_the_wait() -> None:
    shown = text(console.offload_table(fold(_offloaded())))
    row = next(line for line in shown.splitlines() if line.startswith("gpu-node") and " 0 " in line)
    assert row.split() == ["gpu-node", "0", "4.0", "GiB", "@", "4.29", "2.0", "GiB", "@", "2.15", "250", "ms"]
    assert "D2H" in shown and "NVMe read" in shown and "H2D" not in shown  # only the directions used
    assert console.offload_table(fold(job_records())) is None  # no offload, no table


def test_the_summary_fits_120_columns_with_nothing_cut_even_for_a_long_host_and_every_direction(
        tmp_path: Path) -> None:
    # As one 13-column table, "localhost", "samples/s" and the offload text were cut to "localho…",
    # "samples…", "n…" even at 200 columns, in `zerorun launch` and `zerorun report`.
    records = _offloaded(host="gpu-node-017.cluster.example.com", big=True)
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    report_run = CliRunner().invoke(app, ["report", "--no-plots", str(tmp_path)])  # not a terminal: 120 columns
    assert report_run.exit_code == 0, report_run.output
    for shown in (text(console.summary(fold(records)), width=console.SUMMARY_WIDTH), report_run.stdout):
        assert "…" not in shown
        assert max(len(line.rstrip()) for line in shown.splitlines()) <= 120
        for whole in ("host", "rank", "steps", "samples/s", "tokens/s", "TFLOP/s", "MFU", "peak device", "peak RSS",
                      "skipped", "comm", "I/O", "D2H", "H2D", "NVMe read", "NVMe write", "waited", "16,384",
                      "23.4 GiB", "0.15 s (10%)", "493.6 GiB @ 13.25", "50.00 s", "gpu-node-017.cluster.example.com"):
            assert whole in shown, whole
        first_column = "".join(line.split(" ", 1)[0] for line in shown.splitlines() if line.startswith(("gpu", "le.")))
        assert "gpu-node-017.cluster.example.com" * 3 in first_column  # a long host wraps in its cell, whole


def test_a_restart_starts_the_ranks_over_and_times_the_gap_from_the_failure_to_the_first_step_after_it():
    records = job_records(steps=4)[:-4]  # ranks at step 4, then rank 1 fails
    records.append({"type": "restart", "attempt": 1, "job_id": "demo-1-r1", "world_size": 2,
                    "cause": "rank 1 on gpu-node failed (killed by SIGKILL)", "decision": "restart 1 of 1",
                    "failed_at": 110.0, "torn_down_at": 111.5, "t": 112.0})
    for r in range(2):
        records.append({"type": "hello", "rank": r, "t": 115.0 + r, "host": "gpu-node", "pid": 2000 + r})
        records.append({"type": "engine", "rank": r, "t": 118.0 + r, "params": 10, "global_step": 2,
                        "resumed_from": "step-2"})
    for r in range(2):
        records.append({"type": "step", "rank": r, "t": 120.0 + r, "step": 3, "loss": 1.0, "step_time_s": 0.5,
                        "samples": 8, "tokens": 8192})
    state = fold(records)
    (restart,) = state.restarts
    assert state.step == 3 and state.first_step == 3  # the steps after the resume count again
    assert restart.gap() == {"total": 11.0, "teardown": 1.5, "restart": 0.5, "start": 3.0, "engine": 4.0,
                             "first step": 2.0}
    assert restart.describe() == ("restart 1: rank 1 on gpu-node failed (killed by SIGKILL); resumed from step-2 at "
                                  "step 2, 2 steps run again; 11.0 s from the failure to the first step after it "
                                  "(teardown 1.5, restart 0.5, start 3.0, engine 4.0, first step 2.0 s)")
    shown = text(console.summary(state))
    assert "steps 3-3 of 10 (1 run, resumed after step 2)" in shown and "1 restart (below)" in shown
    assert "[restart 1]" in text(console.live_view(state, now=121.0))


def test_checkpoint_records_show_saves_stall_write_time_and_bytes_live_and_in_the_report(tmp_path: Path):
    from zerorun.runtime.events import CheckpointStats

    records = job_records()
    for step, stall in ((2, 0.25), (4, 0.5)):
        for r in range(2):
            stats = CheckpointStats(f"step-{step}", step, "async", stall + r / 10, 0.0, 3.0, 100 * MiB, 300 * MiB)
            records.insert(-3, {"type": "checkpoint", "rank": r, "t": 105.0 + step, **vars(stats)})
    state = fold(records)
    line = "checkpoints: 2 saved; step-4 (async): training waited 600 ms, written in 3.00 s, 200.0 MiB; " \
           "training waited 950 ms for all of them"
    assert console.checkpoint_line(state) == line  # the slowest rank's times, both ranks' bytes
    assert line in text(console.live_view(state, now=107.0), width=300)
    assert line in text(report.render(state), width=300)
    assert console.checkpoint_line(fold(job_records())) is None


def _with_engine_total(total: object) -> list[dict]:
    """job_records (the launcher said 10 steps) whose engines said `total` (a missing key: an older engine)."""
    records = job_records()
    for r in records:
        if r["type"] == "engine" and total != "unsaid":
            r["total_steps"] = total
    return records


def test_a_script_that_drives_its_own_loop_shows_its_steps_and_no_total_where_none_is_known():
    # An HF Trainer with --max_steps 10 ended with "10/100 steps", the recipe's default train.steps: a job
    # that reads as stopped early. Its engine says no total is known: no total, no percentage, no ETA.
    unknown = fold(_with_engine_total(None)[:-4])
    live = text(console.live_view(unknown, now=107.0))
    assert "step 4 " in live and "/10" not in live and "%" not in live.split("\n")[0] and "ETA" not in live
    assert console.summary_line(unknown, now=107.0).startswith("step 4 elapsed 0:00:07 | loss")
    assert "job demo-1: 4 steps in 0:00:11" in text(console.summary(fold(_with_engine_total(None))))
    assert "job demo-1: 4/4 steps in" in text(console.summary(fold(_with_engine_total(4))))  # the script's own
    assert "job demo-1: 4/10 steps in" in text(console.summary(fold(_with_engine_total("unsaid"))))  # older engines


def test_the_launcher_knows_no_total_for_a_script_that_drives_its_own_loop():
    from zerorun import config
    from zerorun.launch.hostfile import Node
    from zerorun.launch.plan import MachineFacts, plan

    def planned(text: str, *overrides: str) -> int | None:
        recipe = config.loads("script: /x/t.py\n" + text, overrides=list(overrides))
        return plan(recipe, [Node("localhost", (0,))], "j", 1, MachineFacts(2, "py")).steps

    assert planned("train: {steps: 60}\n") == 60  # a zerorun script loops to the train.steps it was given
    assert planned("", "train.steps=80") == 80
    assert planned("train: {steps: 60}\nlaunch: {deepspeed_compat: true}\n") is None  # a DeepSpeed-API script
    # Issue 57: a script counting its own loop (max_iters) showed "7/100 steps ... ETA 0:00:01", 100 being the
    # default the user never set: no total, and so no ETA.
    assert planned("") is None


def test_zerorun_initialize_declares_the_total_only_where_the_user_gave_train_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import zerorun
    from zerorun import config
    from zerorun.telemetry import probe

    declared: list[int | None] = []
    monkeypatch.setattr(probe, "attach_engine", lambda engine, total: declared.append(total))
    import zerorun.runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "Engine", lambda *args: type("E", (), {"resume": lambda self: None})())
    monkeypatch.setattr(zerorun, "_open_profile_window", lambda engine: None)
    model = torch.nn.Linear(2, 2)
    zerorun.initialize(model, config=config.loads("script: t.py\n"))
    zerorun.initialize(model, config=config.loads("script: t.py\ntrain: {steps: 60}\n"))
    assert declared == [None, 60]


def test_the_eta_after_a_first_step_that_built_a_kernel_leaves_the_build_out():
    """Issue 57: step 1 built the CPU Adam kernel (9 s of its time) and the ETA said 9 minutes."""
    records = [r for r in job_records(steps=1) if r["type"] not in ("bye", "end")]
    for r in records:
        if r["type"] == "step":
            r["kernel_build_s"] = 1.5  # of its 2 s
    state = fold(records)
    assert state.eta_s(now=103.0) == pytest.approx(9 * 0.5)
    del records[-2]["kernel_build_s"], records[-4]["kernel_build_s"]  # without the field: 2 s a step
    assert fold(records).eta_s(now=103.0) == pytest.approx(9 * 2.0)


def test_the_summary_says_what_the_overlapped_host_optimizer_did_and_why_it_rolled_back() -> None:
    # Issue 57: zero.overlap_optimizer could not be seen working (no log line, field or summary said it ran).
    records = job_records(steps=4)
    for r in records:
        if r["type"] == "step":
            rolled = 1 if r["step"] >= 3 else 0
            r["offload"] = {"overlap": {"applied": r["step"] - rolled, "rolled_back": rolled,
                                        "seconds": 0.5 * r["step"], "waited": 0.125 * r["step"]},
                            **({"overlap_rollbacks": {"clipped": 1}} if rolled else {})}
    shown = text(console.summary(fold(records)))
    assert ("host optimizer under the backward (zero.overlap_optimizer): 3 step(s) applied as made, 1 rolled back "
            "and run again (clipped 1); 4.00 s of host updates over 2 rank(s), 3.00 s of it hidden under the backward "
            "(1.00 s waited for)") in " ".join(shown.split())
    assert console.overlap_line(fold(job_records())) is None  # no overlap, no line
