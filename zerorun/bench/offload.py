"""`zerorun bench offload`: one-GPU ZeRO-Offload, zerorun's modes beside DeepSpeed's, in one command.

    zerorun bench offload                        # the 3.7B GPT of recipes/offload_one_gpu.yaml, every system
    zerorun bench offload --quick                # a 0.6B GPT, zerorun (overlap on) beside DeepSpeed, 1 round

Each (round, system) trains the same GPT on the same batches in a fresh process, one rank (world size
1), bf16, activation checkpointing, the fp32 master weights and Adam moments in pinned host memory;
rounds interleave the systems so drift hits each alike. A step is timed to a device synchronisation,
and so are its phases (forward, backward, optimizer: with the host optimizer under the backward,
its time moves into the backward's). Reported per system: the mean step after the first (a warm-up),
tokens/s, model TFLOP/s (6 x parameters x tokens) and MFU against the device's bf16 peak, the host's
peak RSS, the GPU's peak allocation, where the step goes, and the last loss (the systems train the
same model: their losses agree to rounding). DeepSpeed runs where `deepspeed` imports (its CPU Adam
builds at first use); elsewhere its rows say why they are missing. On a machine without CUDA every
system still runs, on the CPU, with a small model: the command is tested there.
"""

from __future__ import annotations

import importlib.util
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from zerorun.bench.gpt import GPT, synthetic_tokens
from zerorun.bench.shape import GPTConfig
from zerorun.bench.spawn import RankFailure, run_ranks

ZERO = {  # zerorun's systems: recipe overrides
    "zero2-host": ["zero.stage=2", "zero.offload_optimizer=cpu", "zero.overlap_optimizer=false"],
    "zero2-host-overlap": ["zero.stage=2", "zero.offload_optimizer=cpu", "zero.overlap_optimizer=true"],
    "zero3-host": ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu",
                   "zero.overlap_optimizer=false"],
    "zero3-host-overlap": ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu",
                           "zero.overlap_optimizer=true"],
}
DEEPSPEED = {"deepspeed2-offload": 2, "deepspeed3-offload": 3}  # ZeRO-Offload: DeepSpeedCPUAdam, pinned
SYSTEMS = (*ZERO, *DEEPSPEED)
DESCRIPTIONS = {
    "zero2-host": "zerorun stage 2, optimizer on the host",
    "zero2-host-overlap": "zerorun stage 2, optimizer on the host, under the backward",
    "zero3-host": "zerorun stage 3, optimizer + parameters on the host",
    "zero3-host-overlap": "zerorun stage 3, optimizer + parameters on the host, under the backward",
    "deepspeed2-offload": "DeepSpeed ZeRO-Offload stage 2 (DeepSpeedCPUAdam)",
    "deepspeed3-offload": "DeepSpeed ZeRO-3 Offload (optimizer + parameters)",
}
FULL = GPTConfig(layers=32, d_model=3072, heads=24, vocab=8192, seq_len=1024, checkpoint="non-reentrant")
QUICK = GPTConfig(layers=12, d_model=2048, heads=16, vocab=8192, seq_len=1024, checkpoint="non-reentrant")
ON_CPU = GPTConfig(layers=2, d_model=128, heads=4, vocab=512, seq_len=64, checkpoint="non-reentrant")


@dataclass(frozen=True)
class OffloadBenchConfig:
    model: GPTConfig
    micro_batch: int
    steps: int  # timed steps per run, after one warm-up step
    rounds: int
    systems: tuple[str, ...]

    @classmethod
    def default(cls, quick: bool, systems: tuple[str, ...] | None = None) -> OffloadBenchConfig:
        """The documented model on a GPU (quick: a smaller one, fewer systems), a small one on a CPU."""
        cuda = torch.cuda.is_available()
        model = (QUICK if quick else FULL) if cuda else ON_CPU
        chosen = systems or (("zero2-host-overlap", "deepspeed2-offload") if quick else SYSTEMS)
        return cls(model, 16 if cuda else 2, 2 if quick else 3, 1 if quick else 2, chosen)


@dataclass
class Run:
    """One system's run: phase seconds per timed step, memory, the last loss."""

    forward_s: list[float]
    backward_s: list[float]
    optimizer_s: list[float]
    host_peak_gib: float
    gpu_peak_gib: float | None
    final_loss: float
    params: int
    device: str


@dataclass
class Row:
    """One system's figures (None where it did not run; `note` says why)."""

    system: str
    params: int | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    host_peak_gib: float | None = None
    gpu_peak_gib: float | None = None
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    final_loss: float | None = None
    note: str = ""


def _build(system: str, model: torch.nn.Module, cfg: OffloadBenchConfig, bf16: bool) -> tuple[Callable, Callable,
                                                                                             Callable]:
    """(forward, backward, step) of `system` around `model`."""
    if system in ZERO:
        import zerorun
        from zerorun import config

        recipe = config.loads("script: bench", "<bench offload>", [
            *ZERO[system], f"precision.dtype={'bf16' if bf16 else 'fp32'}", "zero.bucket_mb=200",
            "zero.allgather_bucket_mb=200", "optimizer.lr=1e-4", "optimizer.weight_decay=0.0", "telemetry.enabled=false",
            "name=bench-offload"])
        engine = zerorun.initialize(model, None, recipe)
        return engine, engine.backward, engine.step
    import deepspeed

    stage = DEEPSPEED[system]
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds_config = {"train_micro_batch_size_per_gpu": cfg.micro_batch, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": bf16}, "zero_optimization": zero,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    return engine, engine.backward, engine.step


def _train(rank: int, world: int, system: str, cfg: OffloadBenchConfig) -> Run:
    from zerorun.runtime.comm.dist import init_distributed

    info = init_distributed()
    cuda = info.device.type == "cuda"
    bf16 = cuda  # the CPU fallback trains in fp32: bf16 matmuls on a CPU measure nothing of interest
    torch.manual_seed(0)
    with info.device:
        model = GPT(cfg.model)  # fp32: zerorun and DeepSpeed each cast it to bf16 themselves
    params = sum(p.numel() for p in model.parameters())
    forward, backward, step = _build(system, model, cfg, bf16)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    loss = torch.zeros(())
    for i in range(cfg.steps + 1):
        tokens = synthetic_tokens(cfg.model, cfg.micro_batch, 0, 0, i).to(info.device)
        sync()
        marks = [time.perf_counter()]
        loss = forward(tokens)
        sync()
        marks.append(time.perf_counter())
        backward(loss)
        sync()
        marks.append(time.perf_counter())
        step()
        sync()
        marks.append(time.perf_counter())
        if i:  # the first step warms up (kernel builds, allocator, pinned buffers)
            for name, a, b in zip(times, marks, marks[1:]):
                times[name].append(b - a)
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gpu = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return Run(times["forward"], times["backward"], times["optimizer"], host, gpu, float(loss.detach().float()),
               params, torch.cuda.get_device_name() if cuda else "cpu")


def missing(system: str) -> str | None:
    """Why `system` cannot run here, or None."""
    if system in DEEPSPEED and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed does not import here (docs/gpu.md: carrying it to a machine without network)"
    return None


def run(cfg: OffloadBenchConfig, progress: Callable[[str], None] = lambda line: None) -> list[Row]:
    """Every system, `cfg.rounds` times, interleaved; one row per system (medians over rounds)."""
    runs: dict[str, list[Run]] = {s: [] for s in cfg.systems}
    notes: dict[str, str] = {s: why for s in cfg.systems if (why := missing(s))}
    for r in range(cfg.rounds):
        order = [s for s in cfg.systems[r % len(cfg.systems):] + cfg.systems[:r % len(cfg.systems)] if s not in notes]
        for system in order:
            try:
                runs[system].append(run_ranks(_train, 1, (system, cfg), timeout=1800)[0])
                last = runs[system][-1]
                progress(f"round {r} {system}: {statistics.mean(_steps(last)):.3f} s/step, loss {last.final_loss:.4f}")
            except RankFailure as failure:
                notes[system] = str(failure).strip().splitlines()[-1][:200]
                progress(f"round {r} {system}: failed: {notes[system]}")
    return [_row(system, runs[system], cfg, notes.get(system, "")) for system in cfg.systems]


def _steps(run: Run) -> list[float]:
    return [sum(parts) for parts in zip(run.forward_s, run.backward_s, run.optimizer_s)]


def _row(system: str, runs: list[Run], cfg: OffloadBenchConfig, note: str) -> Row:
    if not runs:
        return Row(system, note=note or "did not run")
    from zerorun.telemetry.flops import peak_tflops

    step = statistics.median(statistics.mean(_steps(r)) for r in runs)
    tokens = cfg.micro_batch * cfg.model.seq_len
    tflops = 6 * runs[0].params * tokens / step / 1e12
    peak = peak_tflops(runs[0].device, "bf16")
    phase = {name: statistics.median(statistics.mean(getattr(r, f"{name}_s")) for r in runs)
             for name in ("forward", "backward", "optimizer")}
    gpu = runs[0].gpu_peak_gib
    return Row(system, runs[0].params, step, tokens / step, tflops, tflops / peak if peak else None, max(r.host_peak_gib for r in runs),
               max(r.gpu_peak_gib or 0 for r in runs) if gpu is not None else None, phase["forward"], phase["backward"],
               phase["optimizer"], runs[-1].final_loss, note)


def render(cfg: OffloadBenchConfig, rows: list[Row]) -> Any:
    from rich.table import Table

    m = cfg.model
    params = next((r.params for r in rows if r.params), None)
    size = (f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M") + " parameters" if params else "not built"
    table = Table(title=f"ZeRO-Offload on one device: GPT {m.layers} x {m.d_model} ({size}), "
                        f"{cfg.micro_batch} x {m.seq_len} tokens a step, {cfg.steps} timed steps x {cfg.rounds} rounds")
    for column in ("system", "step", "x DeepSpeed", "tokens/s", "TFLOP/s", "MFU", "host RSS", "GPU peak",
                   "fwd / bwd / opt", "loss"):
        table.add_column(column)
    deepspeed = {DEEPSPEED[r.system]: r.step_s for r in rows if r.system in DEEPSPEED and r.step_s}
    for row in rows:
        if row.step_s is None:
            table.add_row(f"{DESCRIPTIONS[row.system]}\n[dim]{row.note}[/dim]", "-", *[""] * 8)
            continue
        stage = DEEPSPEED.get(row.system) or (2 if row.system.startswith("zero2") else 3)
        ratio = f"{row.step_s / deepspeed[stage]:.2f}x" if stage in deepspeed else ""
        table.add_row(DESCRIPTIONS[row.system], f"{row.step_s:.3f} s", ratio, f"{row.tokens_per_s:,.0f}",
                      f"{row.tflops:.1f}", f"{row.mfu:.1%}" if row.mfu else "", f"{row.host_peak_gib:.1f} GiB",
                      f"{row.gpu_peak_gib:.1f} GiB" if row.gpu_peak_gib is not None else "",
                      f"{row.forward_s:.2f} / {row.backward_s:.2f} / {row.optimizer_s:.2f} s", f"{row.final_loss:.4f}")
    return table


def as_json(cfg: OffloadBenchConfig, rows: list[Row]) -> dict[str, Any]:
    return {"config": asdict(cfg), "rows": [asdict(r) for r in rows]}
