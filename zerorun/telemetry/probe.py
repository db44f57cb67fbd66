"""The worker's side of telemetry: a background thread per rank that streams JSON lines to the launcher.

    probe.start("127.0.0.1:41234", recipe.telemetry, rank=0, host="node-0", device=device)  # worker
    probe.attach_engine(engine, total_steps=recipe.train.steps)                  # zerorun.initialize
    probe.set_model_flops(per_sample=count_training_flops(model, batch) / batch_size)  # optional
    probe.stop()                                                                 # worker, at the end

Records (one JSON object per line; every one has `type`, `rank` and `t`, the worker's wall clock):
- `hello`  on every (re)connection: host, pid, pid_start (its create time), local_rank, device.
- `engine` once an engine exists: params, stage, dtype, device_name, peak_tflops, flops_per_token,
           total_steps (the steps the script is known to run: the recipe's train.steps for a zerorun
           script, a DeepSpeed config's scheduler total for one that drives its own loop; null: unknown).
- `step`   per optimizer step, from the engine's `events.StepStats`: step, loss, lr, grad_norm,
           loss_scale, skipped, skipped_total, step_time_s, samples, tokens, samples_per_s,
           tokens_per_s, flops, tflops, mfu, comm (cumulative bytes/calls/seconds per collective).
- `sample` every `telemetry.interval_s`: rss, cpu_percent, cuda (allocated/reserved/peak) or null,
           memory (`engine.memory().as_dict()`), io (the process's block-device bytes read and
           written: NVMe offload and checkpoints), where (the training thread's innermost frame,
           and whether it waits in a collective), dropped (records lost to a full queue).
- `checkpoint` per checkpoint save, when it is committed (`events.CheckpointStats`, flat): tag, step,
           mode (async, sync, sync-fallback), stall_s, waited_s, write_s, bytes, snapshot_bytes.
- `bye`    when the worker's script has ended.

It must never slow or break training:
- On the training thread, the step listener only appends the engine's `StepStats` to a bounded
  deque (the oldest is dropped when full); the float conversion of the loss, JSON and sockets all
  happen on the probe's daemon thread.
- A CUDA loss is read only after an event recorded behind it has completed, and on a side stream,
  so the probe never waits for later work nor makes the training stream wait.
- Comm figures are the counters `runtime.collectives` keeps (bytes at launch, host time from launch
  to the end of `wait()`); reading them adds no synchronisation, so overlap is measured, not removed.
- On connecting, the probe answers the collector's challenge with the job's token (TOKEN_ENV,
  from its environment; see `collector`) before its first record.
- The socket has a short timeout. A failed connect or send drops the connection and retries with
  backoff (up to 5 s); meanwhile records wait in a bounded deque (oldest dropped). Every failure
  inside the thread is swallowed: a dead launcher never ends a worker, the supervisor's teardown does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections import deque
from typing import Any

import psutil

from zerorun import ops
from zerorun.config import TelemetryConfig
from zerorun.telemetry import TOKEN_ENV
from zerorun.telemetry.flops import ModelFlops, peak_tflops
from zerorun.telemetry.probed_engine import ProbedEngine
from zerorun.telemetry.records import prove
from zerorun.telemetry.whereabouts import last_collective, where, where_raised

log = logging.getLogger("zerorun")

STEP_QUEUE = 4096  # steps waiting for the probe thread (drop oldest beyond)
OUTBOX = 8192  # records waiting for the launcher (drop oldest beyond)
FLUSH_S = 0.25  # steps reach the launcher at least this often
SOCKET_TIMEOUT_S = 1.0
MAX_BACKOFF_S = 5.0
_BATCH_BYTES = 256 * 1024
_probe: Probe | None = None
_flops_override: dict[str, float | None] = {}


def start(address: str, telemetry: TelemetryConfig, rank: int, host: str, device: Any = None) -> Probe:
    """Start this process's probe (one per process; a second call returns the running one)."""
    global _probe
    if _probe is None:
        _probe = Probe(address, telemetry, rank, host, device)
        _probe.start()
    return _probe


def current() -> Probe | None:
    return _probe


def stop(timeout: float = 2.0) -> None:
    """Send what is left (a last sample and `bye`) for up to `timeout` seconds, then stop."""
    global _probe
    if _probe is not None:
        _probe.stop(timeout)
        _probe = None


def script_ended(raised: BaseException | None = None) -> None:
    """The script has returned or raised: samples stop saying where the training thread is.

    From here on its frames are the worker's exit (printing a traceback, shutting down), which
    would read as "not in a collective" and overwrite what the launcher last saw: a rank that
    failed waiting for a hung peer then looked like a culprit itself, and the report could not
    name the peer (seen in CI with shared-memory collectives).

    When it raised, later samples say where the exception came from instead (`whereabouts.where_raised`): the
    last periodic sample may be older than the raise (it can find the rank in a barrier it has
    since left), and a rank that raised in its own code must not pass for a victim of its peers."""
    if _probe is not None:
        _probe.raised_at = where_raised(raised) if raised is not None else None
        _probe.script_running = False


def attach_engine(engine: ProbedEngine, total_steps: int | None = None) -> None:
    """Tell the running probe (if any) about the engine: memory figures, the model's FLOPs, and the
    steps the script will run where they are known (None: the progress shows no total)."""
    if _probe is not None:
        _probe.total_steps = total_steps
        _probe.attach_engine(engine)


def set_model_flops(per_token: float | None = None, per_sample: float | None = None) -> None:
    """Override the model FLOPs of one training step (default: 6 x params per token).

    Use `per_sample` for models whose inputs are not tokens, e.g. with a measured count from
    `zerorun.telemetry.flops.count_training_flops(model, batch) / batch_size`.
    """
    _flops_override.update(per_token=per_token, per_sample=per_sample)
    engine = _probe.engine() if _probe is not None else None
    if engine is not None:
        _probe.attach_engine(engine)  # sends the engine record again, with the new counts


class Probe:
    """Samples this rank and streams records to the launcher's collector from a daemon thread."""

    def __init__(self, address: str, telemetry: TelemetryConfig, rank: int, host: str, device: Any = None) -> None:
        host_part, _, port = address.rpartition(":")
        self.address = (host_part.strip("[]"), int(port))
        self.interval_s = telemetry.interval_s
        self.peak_override = telemetry.peak_tflops
        self.rank = rank
        self.host = host
        self.device = device
        self.token = os.environ.get(TOKEN_ENV)
        self._process = psutil.Process()
        self._main_thread = threading.main_thread().ident
        self.script_running = True  # False once the script has ended (`script_ended`): `where` is then None
        self.raised_at: dict[str, Any] | None = None  # or where the script's exception was raised
        self.total_steps: int | None = None  # the steps the script will run, where known (`attach_engine`)
        self._steps: deque[tuple[Any, Any, float | None, float]] = deque(maxlen=STEP_QUEUE)
        self._build_seen = 0.0  # ops.build_seconds() at the last step: the first builds the Adam kernel (set-up)
        self._outbox: deque[bytes] = deque(maxlen=OUTBOX)
        self._dropped = 0
        self._engine: weakref.ReferenceType | None = None
        self._engine_record: dict[str, Any] | None = None
        self._greeting = threading.Lock()  # the engine record goes out once: in the greeting or, once connected, queued
        self._flops: ModelFlops | None = None
        self._sock: socket.socket | None = None
        self._next_connect = 0.0
        self._backoff = 0.5
        self._side_stream: Any = None
        self._stopping = threading.Event()
        self._wake = threading.Event()  # send now: a checkpoint record, which a teardown must not lose
        self._unsubscribe: Any = None
        self._unsubscribe_checkpoints: Any = None
        self._thread = threading.Thread(target=self._run, name="zerorun-telemetry", daemon=True)

    # -- training thread ------------------------------------------------------------------------

    def start(self) -> None:
        from zerorun.runtime import context

        events = context.current().events  # the engines this thread builds (the worker's: the script's)
        self._process.cpu_percent(None)  # the first call only starts the measurement
        self._unsubscribe = events.subscribe(self._on_step)
        self._unsubscribe_checkpoints = events.subscribe_checkpoints(self._on_checkpoint)
        self._thread.start()

    def _on_step(self, stats: Any) -> None:
        """The engine's step listener: O(1), no device sync, never raises."""
        ready = None
        loss = stats.loss
        if loss is not None and loss.is_cuda:
            import torch

            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(loss.device))  # behind the loss, on the training stream
        if len(self._steps) == self._steps.maxlen:
            self._dropped += 1
        built, self._build_seen = ops.build_seconds() - self._build_seen, ops.build_seconds()
        self._steps.append((stats, ready, self._lr(), built))

    def _lr(self) -> float | None:
        """The learning rate the step just used (the first param group's): read in the step listener,
        before the script's scheduler moves it for the next step."""
        try:
            engine = self.engine()
            return _finite(float(engine.optimizer.param_groups[0]["lr"])) if engine is not None else None
        except Exception:  # noqa: BLE001 - no engine, no groups, an lr that is a tensor: no lr in the record
            return None

    def _on_checkpoint(self, stats: Any) -> None:
        """The engine's checkpoint listener: one small record per save (a few per run), sent at once (a Ctrl-C
        right after a commit ends the workers before the next flush)."""
        self._enqueue({"type": "checkpoint", "rank": self.rank, "t": time.time(), **dataclasses.asdict(stats)})
        self._wake.set()

    def engine(self) -> ProbedEngine | None:
        """The attached engine, while it lives (the probe holds only a weak reference)."""
        return self._engine() if self._engine is not None else None

    def attach_engine(self, engine: ProbedEngine) -> None:
        self._engine = weakref.ref(engine)
        dtype = engine.recipe.precision.dtype
        device = self.device = engine.device
        device_name = _device_name(device)
        peak = self.peak_override or peak_tflops(device_name, dtype)
        params = engine.num_parameters()  # the whole model's, not what stage 3 has gathered right now
        self._flops = ModelFlops(params, **{k: v for k, v in _flops_override.items() if v is not None})
        self._engine_record = {"type": "engine", "rank": self.rank, "params": params,
                               "stage": engine.stage, "dtype": dtype,
                               "device_name": device_name, "peak_tflops": peak,
                               "flops_per_token": self._flops.per_token, "flops_per_sample": self._flops.per_sample,
                               "global_step": engine.global_step,  # after its auto-resume
                               "resumed_from": engine.resumed_from, "total_steps": self.total_steps}
        with self._greeting:
            if self._sock is not None:  # else the connection's greeting carries it
                self._enqueue(dict(self._engine_record, t=time.time()))

    def stop(self, timeout: float = 2.0) -> None:
        for unsubscribe in (self._unsubscribe, self._unsubscribe_checkpoints):
            if unsubscribe is not None:
                unsubscribe()
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    # -- probe thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        next_sample = 0.0
        while not self._stopping.is_set():
            if self._wake.wait(min(self.interval_s, FLUSH_S)):
                self._wake.clear()
            try:
                self._take_steps(wait=False)
                if time.monotonic() >= next_sample:
                    next_sample = time.monotonic() + self.interval_s
                    self._enqueue(self._sample())
                self._send()
            except Exception:  # noqa: BLE001 - telemetry must never break training
                log.debug("zerorun telemetry: probe round failed", exc_info=True)
        try:  # the script ended: everything left, a last sample and goodbye
            self._take_steps(wait=True)
            self._enqueue(self._sample(final=True))
            self._enqueue({"type": "bye", "rank": self.rank, "t": time.time()})
            self._send()
        except Exception:  # noqa: BLE001
            log.debug("zerorun telemetry: final flush failed", exc_info=True)
        self._disconnect()

    def _enqueue(self, record: dict[str, Any]) -> None:
        if len(self._outbox) == self._outbox.maxlen:
            self._dropped += 1
        self._outbox.append(json.dumps(record, separators=(",", ":"), allow_nan=False).encode() + b"\n")

    def _take_steps(self, wait: bool) -> None:
        """Turn queued StepStats into records, in order; a CUDA loss not computed yet waits a round."""
        while self._steps:
            stats, ready, lr, built = self._steps[0]
            if ready is not None and not ready.query():
                if not wait:
                    return
                ready.synchronize()
            self._steps.popleft()
            extra = {"lr": lr, **({"kernel_build_s": built} if built > 0 else {})}
            self._enqueue(self._step_record(stats, self._loss_value(stats.loss)) | extra)

    def _loss_value(self, loss: Any) -> float | None:
        if loss is None:
            return None
        if not loss.is_cuda:
            return float(loss)
        import torch

        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=loss.device)
        with torch.cuda.stream(self._side_stream):  # the value is ready; copy it without queueing behind training
            return float(loss)

    def _step_record(self, stats: Any, loss: float | None) -> dict[str, Any]:
        seconds = stats.step_time_s
        flops = self._flops.step_flops(stats.tokens, stats.samples) if self._flops else None
        tflops = flops / seconds / 1e12 if flops and seconds > 0 else None
        peak = self._engine_record["peak_tflops"] if self._engine_record else None
        return {
            "type": "step", "rank": self.rank, "t": time.time(), "step": stats.step,
            "loss": _finite(loss), "grad_norm": _finite(stats.grad_norm), "loss_scale": _finite(stats.loss_scale),
            "skipped": bool(stats.skipped), "skipped_total": stats.skipped_total, "step_time_s": seconds,
            "samples": stats.samples, "tokens": stats.tokens,
            "samples_per_s": stats.samples / seconds if seconds > 0 else None,
            "tokens_per_s": stats.tokens / seconds if seconds > 0 and stats.tokens else None,
            "flops": flops, "tflops": tflops, "mfu": tflops / peak if tflops is not None and peak else None,
            "comm": stats.comm,
            "offload": stats.offload,
        }

    def _sample(self, final: bool = False) -> dict[str, Any]:
        """Memory, I/O and where the training thread is (not after the script: the bootstrap's frame says nothing)."""
        record: dict[str, Any] = {"type": "sample", "rank": self.rank, "t": time.time()}
        with self._process.oneshot():
            record["rss"] = self._process.memory_info().rss
            record["cpu_percent"] = self._process.cpu_percent(None)
            record["io"] = _io_bytes(self._process)
        record["cuda"] = _cuda_memory(self.device)
        record["memory"] = _engine_memory(self.engine())
        record["where"] = where(self._main_thread) if self.script_running and not final else self.raised_at
        last = last_collective(self.engine()) if record["where"] is not None else None
        if last is not None:
            record["where"] = {**record["where"], "collective": last}
        record["dropped"] = self._dropped
        return record

    # -- connection ------------------------------------------------------------------------------

    def _send(self) -> None:
        while self._outbox:
            sock = self._connection()
            if sock is None:
                return
            batch: list[bytes] = []
            size = 0
            while self._outbox and size < _BATCH_BYTES:
                batch.append(self._outbox.popleft())
                size += len(batch[-1])
            try:
                sock.sendall(b"".join(batch))
            except OSError:
                self._outbox.extendleft(reversed(batch))  # may repeat a few; the collector ignores repeats
                self._disconnect(retry=True)
                return

    def _connection(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        if time.monotonic() < self._next_connect:
            return None
        sock = None
        try:
            sock = socket.create_connection(self.address, timeout=SOCKET_TIMEOUT_S)
            sock.settimeout(SOCKET_TIMEOUT_S)
            proof = self._proof(sock)
        except (OSError, ValueError, KeyError, TypeError):
            if sock is not None:
                sock.close()
            self._disconnect(retry=True)
            return None
        with self._greeting:  # an engine attached before this point is in the greeting, one after it is queued
            greeting = [self._hello()] + ([dict(self._engine_record, t=time.time())] if self._engine_record else [])
            self._sock = sock
        try:
            sock.sendall(proof + b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in greeting))
        except OSError:
            self._disconnect(retry=True)
            return None
        self._backoff = 0.5
        return sock

    def _proof(self, sock: socket.socket) -> bytes:
        """The line that answers the collector's challenge (nothing without a token)."""
        if self.token is None:
            return b""
        line = b""
        while not line.endswith(b"\n"):
            chunk = sock.recv(256)
            if not chunk or len(line) > 256:
                raise OSError("no challenge from the collector")
            line += chunk
        challenge = json.loads(line)["challenge"]
        return json.dumps({"auth": prove(self.token, str(challenge))}).encode() + b"\n"

    def _disconnect(self, retry: bool = False) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        if retry:
            self._next_connect = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def _hello(self) -> dict[str, Any]:
        return {"type": "hello", "rank": self.rank, "t": time.time(), "host": self.host, "pid": os.getpid(),
                "pid_start": self._process.create_time(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                "device": str(self.device) if self.device is not None else None}


# -- measurements ------------------------------------------------------------------------------


def _engine_memory(engine: ProbedEngine | None) -> dict[str, dict[str, int]] | None:
    if engine is None:
        return None
    for _ in range(3):  # the training thread may resize a list we iterate: just try again
        try:
            return engine.memory().as_dict()
        except RuntimeError:
            continue
        except Exception:  # noqa: BLE001 - mid-step state the accounting does not expect: this sample has no memory,
            return None  # the sample itself still goes (a lost sample left ranks without a memory peak)
    return None


def _cuda_memory(device: Any) -> dict[str, int] | None:
    """The caching allocator's figures (host-side counters: no sync); None without CUDA in use."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "peak": torch.cuda.max_memory_allocated(device)}


def _device_name(device: Any) -> str | None:
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    import torch

    try:
        return torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001
        return None


def _io_bytes(process: psutil.Process) -> dict[str, int] | None:
    try:
        counters = process.io_counters()
    except (AttributeError, psutil.Error, OSError):
        return None
    return {"read_bytes": counters.read_bytes, "write_bytes": counters.write_bytes}


def _finite(value: float | None) -> float | None:
    """JSON has no inf/nan: an overflowed norm travels as null (with `skipped` telling why)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
