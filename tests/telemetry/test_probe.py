"""The worker's probe, in this process: what it sends, and that a dead or frozen launcher never blocks training."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from zerorun import config
from zerorun.runtime import context, events
from zerorun.runtime.memory import MemoryReport
from zerorun.telemetry import probe as probe_module
from zerorun.telemetry import whereabouts
from zerorun.telemetry.collector import Collector
from zerorun.telemetry.probe import OUTBOX, SOCKET_TIMEOUT_S, Probe
from zerorun.telemetry.whereabouts import where

FAST = config.TelemetryConfig(interval_s=0.05)


class FakeEngine:
    """What the probe reads from an engine: module, recipe, device, stage, memory()."""

    def __init__(self) -> None:
        self.module = nn.Linear(10, 10)  # 110 parameters
        self.recipe = config.from_dict({"script": "train.py"}, "<test>")
        self.device = torch.device("cpu")
        self.stage = 2
        self.global_step = 0
        self.resumed_from = None
        self.where = SimpleNamespace(last_collective=lambda: "step 3, micro-step 6, backward, all-gather of unit h.0")

    def num_parameters(self) -> int:
        return 110

    def memory(self) -> MemoryReport:
        report = MemoryReport()
        report.add("params", "cpu", 440)
        report.add("optimizer", "nvme", 880)
        return report


def stats(step: int, seconds: float = 0.5) -> events.StepStats:
    return events.StepStats(step=step, loss=torch.tensor(2.0 / step), grad_norm=float("inf") if step == 2 else 1.5,
                            loss_scale=1.0, skipped=step == 2, skipped_total=int(step >= 2), step_time_s=seconds,
                            samples=4, tokens=4 * 128, comm={"all_reduce": {"bytes": 8.0 * step, "calls": step,
                                                                            "seconds": 0.01 * step}})


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_probe_sends_hello_engine_steps_samples_and_bye_that_the_collector_folds_per_rank(tmp_path: Path):
    collector = Collector(tmp_path / "telemetry.jsonl")
    probe = Probe(collector.start(), FAST, rank=3, host="node-7", device=torch.device("cpu"))
    engine = FakeEngine()
    probe.start()
    try:
        probe.attach_engine(engine)
        for step in (1, 2, 3):
            context.current().events.emit(stats(step))
        wait_until(lambda: collector.state.ranks.get(3) is not None and collector.state.ranks[3].step == 3
                   and collector.state.ranks[3].memory is not None)
    finally:
        probe.stop()
        collector.close()
    rank = collector.state.ranks[3]
    assert (rank.host, rank.finished, rank.params, rank.skipped_total) == ("node-7", True, 110, 1)
    assert rank.loss == pytest.approx(2.0 / 3) and rank.grad_norm == 1.5
    assert rank.tflops == pytest.approx(6 * 110 * 512 / 0.5 / 1e12) and rank.mfu is None  # CPU: no peak
    assert rank.memory == engine.memory().as_dict() and rank.nvme_bytes == 880
    assert rank.comm["all_reduce"]["calls"] == 3
    assert rank.rss and rank.rss > 0
    lines = (tmp_path / "telemetry.jsonl").read_text()
    assert '"grad_norm":null' in lines and "Infinity" not in lines  # an overflowed norm is valid JSON


def test_a_script_can_give_its_own_flop_count_per_sample(tmp_path: Path):
    from zerorun.telemetry import probe as probe_module

    collector = Collector(tmp_path / "telemetry.jsonl")
    probe_module.start(collector.start(), FAST, rank=0, host="h")
    engine = FakeEngine()
    try:
        probe_module.attach_engine(engine)
        probe_module.set_model_flops(per_sample=1e9)  # e.g. count_training_flops(model, batch) / len(batch)
        context.current().events.emit(stats(1))
        wait_until(lambda: 0 in collector.state.ranks and collector.state.ranks[0].step == 1)
    finally:
        probe_module.set_model_flops()  # back to 6 x params per token
        probe_module.stop()
        collector.close()
    assert collector.state.ranks[0].tflops == pytest.approx(1e9 * 4 / 0.5 / 1e12)
    assert probe_module.current() is None


def _big_step(step: int) -> Any:
    big = stats(step)
    big.comm = {f"kind{i}": {"bytes": 1.0, "calls": 1, "seconds": 0.0} for i in range(50)}  # fills buffers fast
    return big


def test_a_frozen_or_dead_launcher_never_fills_memory_and_stop_is_bounded():
    frozen = socket.create_server(("127.0.0.1", 0), backlog=1)  # accepts into its backlog, never reads
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]  # nothing listens here once closed
    try:
        for address in (f"127.0.0.1:{frozen.getsockname()[1]}", f"127.0.0.1:{dead_port}"):
            probe = Probe(address, FAST, rank=0, host="h")
            probe.start()
            big = _big_step(1)
            for step in range(1, 20_001):
                big.step = step
                context.current().events.emit(big)
            time.sleep(0.3)  # let the probe thread try to send
            started = time.monotonic()
            probe.stop(timeout=2.0)
            assert time.monotonic() - started < 2.0 + SOCKET_TIMEOUT_S
            assert len(probe._outbox) <= OUTBOX
    finally:
        frozen.close()


class StuckSocket:
    """A connection to a launcher that stopped reading: `sendall` blocks (until released), as on a full buffer."""

    def __init__(self) -> None:
        self.inside, self.release = threading.Event(), threading.Event()

    def sendall(self, data: bytes) -> None:
        self.inside.set()
        self.release.wait()

    def close(self) -> None:
        self.release.set()


def test_the_step_listener_never_waits_for_the_probes_send():
    """No wall-clock bound: the probe's send is blocked for as long as the test holds it, so a listener that waited
    for it (a lock the sender holds, a full queue it blocks on) would never return."""
    stuck = StuckSocket()
    probe = Probe("127.0.0.1:1", FAST, rank=0, host="h")
    probe._connection = lambda: stuck  # type: ignore[method-assign]
    probe.start()
    events = context.current().events  # the probe listens to this thread's runtime
    emitted = threading.Event()

    def emit_many() -> None:
        big = _big_step(1)
        for step in range(1, 20_001):
            big.step = step
            events.emit(big)
        emitted.set()

    try:
        assert stuck.inside.wait(60), "the probe never tried to send"  # its first sample, blocked in the send
        threading.Thread(target=emit_many, daemon=True).start()  # a listener that blocked would hang it, not the test
        assert emitted.wait(120), "a step listener call waited for the probe's blocked send"
        assert not stuck.release.is_set() and len(probe._outbox) <= OUTBOX
    finally:
        stuck.release.set()
        probe.stop(timeout=2.0)


def test_where_names_the_innermost_frame_and_sees_a_thread_waiting_in_torch_distributed():
    here = where(threading.get_ident())
    assert here is not None and here["function"] == "where" and not here["in_collective"]

    release = threading.Event()
    namespace: dict = {}
    fake = compile("def wait_for_peers(event):\n    event.wait()\n", "/x/torch/distributed/distributed_c10d.py", "exec")
    exec(fake, namespace)
    thread = threading.Thread(target=namespace["wait_for_peers"], args=(release,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: (where(thread.ident) or {}).get("in_collective", False))
    finally:
        release.set()
        thread.join()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_loss_is_read_after_its_event_and_allocator_figures_are_sent(tmp_path: Path):
    collector = Collector(tmp_path / "telemetry.jsonl")
    probe = Probe(collector.start(), FAST, rank=0, host="h", device=torch.device("cuda", 0))
    probe.start()
    try:
        x = torch.randn(2048, 2048, device="cuda")
        step = stats(1)
        step.loss = (x @ x).mean().detach()  # still queued on the training stream when emitted
        context.current().events.emit(step)
        wait_until(lambda: 0 in collector.state.ranks and collector.state.ranks[0].step == 1
                   and collector.state.ranks[0].cuda)
    finally:
        probe.stop()
        collector.close()
    rank = collector.state.ranks[0]
    assert rank.loss == pytest.approx(step.loss.item(), rel=1e-6)
    assert rank.device_now and rank.device_now >= x.numel() * 4 and rank.device_peak >= rank.device_now


def _stage3_params(rank: int, world: int) -> dict:
    import zerorun
    from zerorun.bench.gpt import GPT, GPTConfig

    recipe = config.loads("script: t.py", "t.yaml", ["zero.stage=3", "zero.wrap=[Block]",
                                                    "zero.param_persistence_threshold=100"])
    cfg = GPTConfig(layers=2, d_model=48, heads=4, vocab=500, seq_len=16)
    whole = sum(p.numel() for p in GPT(cfg).parameters())
    with zerorun.sharded_init():
        model = GPT(cfg)
    engine = zerorun.initialize(model, None, recipe)
    probe = Probe("127.0.0.1:9", FAST, rank=rank, host="h")  # never started: only its engine record is read
    probe.attach_engine(engine)
    return {"whole": whole, "sent": probe._engine_record["params"], "module": sum(p.numel() for p in model.parameters())}


def test_stage3_with_sharded_init_reports_the_whole_models_parameters_for_tflops():
    from tests.harness import run_ranks

    for r in run_ranks(_stage3_params, 2):
        assert r["sent"] == r["whole"], r  # TFLOP/s = 6 x this x tokens / s
        assert r["module"] < r["whole"] / 10, r  # what the module holds: counting it made TFLOP/s ~2000x too low


def test_once_the_script_has_ended_samples_no_longer_say_where_the_training_thread_is(tmp_path: Path):
    """The worker's exit (printing a traceback) would otherwise read as "not in a collective" and
    overwrite the launcher's last view of a rank that failed waiting for a peer."""
    collector = Collector(tmp_path / "telemetry.jsonl")
    probe = Probe(collector.start(), FAST, rank=0, host="h")
    try:
        assert probe._sample()["where"] is not None
        engine = FakeEngine()
        probe.attach_engine(engine)  # and with an engine (held weakly), its last collective's place, for stall reports
        assert probe._sample()["where"]["collective"] == "step 3, micro-step 6, backward, all-gather of unit h.0"
        probe.script_running = False
        assert probe._sample()["where"] is None
    finally:
        collector.close()  # the probe's thread was never started


def test_after_an_exception_samples_say_where_it_was_raised_and_whether_a_collective_raised_it(tmp_path: Path):
    """The last periodic sample can predate the raise (a rank seen in a barrier it has since left, then
    raising in its own code): the launcher must judge it by where it raised, or blame its peer."""
    namespace: dict = {}
    exec(compile("def all_reduce():\n    raise RuntimeError('peer closed')\n", "/x/torch/distributed/c10d.py", "exec"),
         namespace)

    def own_code() -> None:
        raise ValueError("the script's own bug")

    def victim() -> None:
        namespace["all_reduce"]()

    raised = {}
    for name, fn in (("own", own_code), ("victim", victim)):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test's exceptions
            raised[name] = exc
    own, in_peer_wait = whereabouts.where_raised(raised["own"]), whereabouts.where_raised(raised["victim"])
    assert own is not None and own["function"] == "own_code" and not own["in_collective"]
    assert in_peer_wait is not None and in_peer_wait["function"] == "all_reduce" and in_peer_wait["in_collective"]

    collector = Collector(tmp_path / "telemetry.jsonl")
    probe = Probe(collector.start(), FAST, rank=0, host="h")
    saved = probe_module._probe
    probe_module._probe = probe
    try:
        probe_module.script_ended(raised["own"])
        assert probe._sample()["where"] == own and probe._sample(final=True)["where"] == own
        probe_module.script_ended(None)
        assert probe._sample()["where"] is None
    finally:
        probe_module._probe = saved
        collector.close()
