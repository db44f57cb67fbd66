"""`zerorun bench step`: training-step time and memory of zerorun's stages against DDP and FSDP2.

Every system trains the same model on the same batches. Rounds interleave the systems (the order
rotates each round) and each (round, system) runs in fresh rank processes, so a system's peak
RSS is its own and machine drift hits every system alike. Ratios to DDP (and to `baseline`, e.g.
DDP with fused AdamW, the strong figure to compare with) are taken within a round, then their
median is reported: compare ratios, not absolute seconds, on a shared machine.

Phases are timed on the host without a barrier between them (a barrier would wait for work a
system deliberately leaves in flight, such as stages 1/2's parameter all-gather under the next
forward); the ranks meet once before the first timed step, and the last step's time includes
waiting for everything still in flight, so overlapped work is never left uncounted.
"""

from __future__ import annotations

import contextlib
import gc
import resource
import statistics
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Sequence, cast

import torch
import torch.distributed as dist

from zerorun.bench import compiling, step_profile
from zerorun.bench.gpt import GPT, synthetic_tokens
from zerorun.bench.peers import optimizer_keys, peer_state_mib, peers
from zerorun.bench.spawn import run_ranks
from zerorun.bench.step_results import NS_REFERENCE, Sample, StepBenchConfig, SystemResult, split_optimizer

# zerorun's systems: the recipe overrides each one runs with
ZERO_SYSTEMS = {
    "zero0": ["zero.stage=0"],
    "zero1": ["zero.stage=1"],
    "zero2": ["zero.stage=2"],
    "zero1-async": ["zero.stage=1", "zero.overlap_publish=true"],
    "zero2-async": ["zero.stage=2", "zero.overlap_publish=true"],
    "zero2-sync": ["zero.stage=2", "zero.overlap_publish=false"],
    "zero3": ["zero.stage=3"],
    "zero2-qgz": ["zero.stage=2", "zero.quantized_gradients=true"],
    "zero2-zpp": ["zero.stage=2", "zero.quantized_gradients=true", "zero.quantized_weights=true"],
    "zero3-qgz": ["zero.stage=3", "zero.quantized_gradients=true"],
    "zero3-zpp": ["zero.stage=3", "zero.quantized_gradients=true", "zero.quantized_weights=true"],
    "zero2-zpp-auto": ["zero.stage=2", "zero.quantized_gradients=auto", "zero.quantized_weights=auto"],
    "zero3-zpp-auto": ["zero.stage=3", "zero.quantized_gradients=auto", "zero.quantized_weights=auto"],
    "zero3-lean": ["zero.stage=3", "zero.host_memory=lean"],
    "zero3-hpz": ["zero.stage=3", "zero.hpz_partition_size=2"],
    "zero1-offload": ["zero.stage=1", "zero.offload_optimizer.device=cpu"],
    "zero2-offload": ["zero.stage=2", "zero.offload_optimizer.device=cpu"],
    "zero2-overlap": ["zero.stage=2", "zero.offload_optimizer.device=cpu", "zero.overlap_optimizer=true"],
    "zero3-offload": ["zero.stage=3", "zero.offload_optimizer.device=cpu", "zero.offload_param.device=cpu"],
    "zero3-overlap": ["zero.stage=3", "zero.offload_optimizer.device=cpu", "zero.overlap_optimizer=true"],
    "zero2-nvme": ["zero.stage=2", "zero.offload_optimizer.device=nvme"],
    "zero3-nvme": ["zero.stage=3", "zero.offload_optimizer.device=nvme", "zero.offload_param.device=cpu"],
}
PEERS = ("ddp", "ddp-fused", "fsdp2", "deepspeed2", "deepspeed3")
SYSTEMS = (*PEERS, *ZERO_SYSTEMS)
DESCRIPTIONS = {
    "ddp": "DDP + torch AdamW (default: for-loop on CPU)",
    "ddp-fused": "DDP + torch AdamW(fused=True)",
    "fsdp2": "FSDP2 fully_shard per block (ZeRO-3) + torch AdamW",
    "deepspeed2": "DeepSpeed ZeRO-2 + torch AdamW(fused=True)",
    "deepspeed3": "DeepSpeed ZeRO-3 + torch AdamW(fused=True)",
    "zero0": "zerorun stage 0",
    "zero1": "zerorun stage 1",
    "zero2": "zerorun stage 2",
    "zero1-async": "zerorun stage 1, publish under the next forward",
    "zero2-async": "zerorun stage 2, publish under the next forward",
    "zero2-sync": "zerorun stage 2, publish inside step()",
    "zero3": "zerorun stage 3 (unit per block)",
    "zero2-qgz": "zerorun stage 2, int8 gradients on the network (qgZ)",
    "zero2-zpp": "zerorun stage 2, int8 weights and gradients on the network (qwZ + qgZ)",
    "zero3-qgz": "zerorun stage 3, int8 gradients on the network (qgZ)",
    "zero3-zpp": "zerorun stage 3, int8 weights and gradients on the network (qwZ + qgZ)",
    "zero2-zpp-auto": "zerorun stage 2, qwZ + qgZ where the measured link says they pay (auto)",
    "zero3-zpp-auto": "zerorun stage 3, qwZ + qgZ where the measured link says they pay (auto)",
    "zero3-lean": "zerorun stage 3, host_memory lean",
    "zero3-hpz": "zerorun stage 3, secondary copy in node groups of 2 (hpZ)",
    "zero1-offload": "zerorun stage 1, optimizer on CPU",
    "zero2-offload": "zerorun stage 2, optimizer on CPU",
    "zero2-overlap": "zerorun stage 2, optimizer on CPU, stepped under the backward (overlap_optimizer)",
    "zero3-offload": "zerorun stage 3, optimizer + params on CPU",
    "zero3-overlap": "zerorun stage 3, optimizer on CPU, stepped under the backward (overlap_optimizer)",
    "zero2-nvme": "zerorun stage 2, optimizer on NVMe",
    "zero3-nvme": "zerorun stage 3, optimizer on NVMe, params on CPU",
}


def describe(system: str, optimizer: str = "adamw") -> str:
    """The table's name of a system, compiled ones included (`zero2+compile`), with another `optimizer` than AdamW
    (or the one the system names: `zero2@muon`)."""
    if system == NS_REFERENCE:
        return "torch Muon.step() alone, one process (T_NS)"
    system, optimizer = split_optimizer(system, optimizer)
    base, mode = compiling.split_system(system)
    text = DESCRIPTIONS[base] if optimizer == "adamw" else \
        DESCRIPTIONS[base].replace("torch AdamW(fused=True)", optimizer).replace("torch AdamW", optimizer)
    text = text if optimizer == "adamw" or optimizer in text else f"{text}, {optimizer}"
    return f"{text}, {compiling.describe_mode(mode)}" if mode else text


def _train(rank: int, world: int, system: str, cfg: StepBenchConfig) -> Sample:
    system, optimizer = split_optimizer(system, cfg.optimizer)
    cfg = replace(cfg, optimizer=optimizer)
    import zerorun
    from zerorun import config
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    from zerorun.runtime import host_allocator

    host_allocator.install()  # as the worker does: zero.host_memory applies
    system, compile = compiling.split_system(system)
    if compile is not None:
        compiling.reset()
    torch.manual_seed(0)
    # stage 3 builds the way a user of a large model does: never whole on any rank (same values)
    with zerorun.sharded_init() if system.startswith("zero3") else contextlib.nullcontext():
        model = GPT(cfg.model)
    batches = [synthetic_tokens(cfg.model, cfg.micro_batch, 0, rank, i) for i in range(cfg.warmup + cfg.steps)]
    if system in ZERO_SYSTEMS:
        if compile == "block":
            compiling.compile_blocks(model)
        elif compile == "whole":
            model = cast(GPT, torch.compile(model))
        nvme = [f"zero.offload_optimizer.nvme_path={cfg.nvme_path}"] if system.endswith("nvme") else []
        recipe = config.loads("script: bench", "<bench>", [*ZERO_SYSTEMS[system], *nvme, "zero.wrap=[Block]",
                                                         f"precision.dtype={cfg.precision}", *optimizer_keys(cfg),
                                                         "name=bench-step", *cfg.overrides])
        engine = zerorun.initialize(model, None, recipe)
        forward, backward, step, settle = engine, engine.backward, engine.step, engine.wait_published
        state_mib = lambda: engine.memory().model_states() / 2**20  # noqa: E731
        snapshot = step_profile.counters(engine.comm.stats)
    else:
        wrapped, opts = peers(system, model, cfg, compile)
        forward, backward, settle = wrapped, lambda loss: loss.backward(), lambda: None

        def step() -> None:
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=False)  # keep gradients allocated, as steady-state training does
        if system.startswith("deepspeed"):
            backward, step = wrapped.backward, wrapped.step
        state_mib = lambda: peer_state_mib(model, opts)  # noqa: E731
        snapshot = step_profile.counters(None)
    times, final_loss, delta, first_s = _timed(batches, cfg.warmup, forward, backward, step, settle, snapshot)
    steps = [sum(parts) for parts in zip(*times.values())]
    dynamo = compiling.counts().describe() if compile is not None else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    backward(forward(batches[-1]))  # untimed: the census is taken where gradients and buffers peak
    live = None if system.startswith("ddp") else live_tensor_bytes(model) / 2**20
    settle()
    return Sample(steps, times["forward"], times["backward"], times["optimizer"], rss, state_mib(), final_loss,
                  live, delta.get("link_bytes"), step_profile.profile_of(delta), first_s, dynamo)


def live_tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage reachable from Python (and the model's gradients, which autograd
    creates without a Python object), each counted once: the census to hold against the ZeRO formulas.
    Storages held only by C++ (DDP's gradient buckets, a collective's scratch) are not seen."""
    gc.collect()
    tensors = [t for t in gc.get_objects() if _is_tensor(t)]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_meta or _fake(t):
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _fake(t: torch.Tensor) -> bool:
    """A tensor torch.compile traced with (dynamo keeps some alive): it has no memory to count."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def _is_tensor(obj: object) -> bool:
    return issubclass(type(obj), torch.Tensor)  # type(), not isinstance: proxies and deprecated aliases answer
                                                 # isinstance through __class__, with warnings or errors


def _timed(batches: list[torch.Tensor], warmup: int, forward: Callable, backward: Callable, step: Callable,
           settle: Callable[[], None], snapshot: Callable[[], dict[str, float]],
           ) -> tuple[dict[str, list[float]], float, dict[str, float], float]:
    """Seconds of each phase of each step after `warmup`, the last loss, how the counters of `snapshot`
    (step_profile.py) grew per timed step, and the seconds of the warm-up steps (where torch.compile compiles);
    `settle` finishes what a step leaves in flight."""
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    before: dict[str, float] = {}
    started = _now()
    warm_up_s = 0.0
    for i, tokens in enumerate(batches):
        if i == warmup:  # every rank starts the timed steps together, owing nothing to the warm-up
            settle()
            dist.barrier()
            warm_up_s = _now() - started
            before = snapshot()
        marks = [_now()]
        loss = forward(tokens)
        marks.append(_now())
        backward(loss)
        marks.append(_now())
        step()
        if i == len(batches) - 1:  # what the last step left in flight, finished and counted
            settle()
            dist.barrier()
        marks.append(_now())
        if i >= warmup:
            for name, a, b in zip(times, marks, marks[1:]):
                times[name].append(b - a)
    return times, float(loss.detach()), step_profile.per_step(before, snapshot(), len(batches) - warmup), warm_up_s


def _now() -> float:
    if torch.cuda.is_available():  # this stream's kernels only: a collective left in flight stays in flight
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()


Spawn = Callable[[Callable[..., Any], tuple], list[Any]]  # run fn(rank, world, *args) on every rank


def run(cfg: StepBenchConfig, progress: Callable[[str], None] = print, spawn: Spawn | None = None,
        ) -> list[SystemResult]:
    """Run the interleaved rounds; return one result per system (medians). `spawn` starts the ranks
    (default: `cfg.world_size` local processes; `cluster_spawn.run_ranks_on` for an emulated cluster)."""
    spawn = spawn or (lambda fn, args: run_ranks(fn, cfg.world_size, args, timeout=1800, threads=cfg.threads))
    compiled = any(compiling.split_system(s)[1] for s in cfg.systems)
    with compiling.fresh_cache() if compiled else contextlib.nullcontext():
        return _rounds(cfg, progress, spawn)


def _rounds(cfg: StepBenchConfig, progress: Callable[[str], None], spawn: Spawn) -> list[SystemResult]:
    from zerorun.bench import step_muon

    samples: dict[str, list[Sample]] = {s: [] for s in cfg.systems}
    ratios: dict[str, dict[str, list[float]]] = {base: {s: [] for s in cfg.systems} for base in {"ddp", cfg.baseline}}
    for round_index in range(cfg.rounds):
        shift = round_index % len(cfg.systems)
        order = cfg.systems[shift:] + cfg.systems[:shift]
        this_round = {}
        for system in order:
            if system == NS_REFERENCE:  # one process, wherever the ranks run
                sample = run_ranks(step_muon.newton_schulz, 1, (replace(cfg, optimizer="muon"),), timeout=1800,
                                   threads=cfg.threads)[0]
            else:
                sample = spawn(_train, (system, cfg))[0]
            samples[system].append(sample)
            this_round[system] = statistics.median(sample.step_s)
            progress(f"round {round_index + 1}/{cfg.rounds} {system:10s} {this_round[system]:.3f} s/step, warm-up "
                     f"{sample.first_step_s:.1f} s")
        for base, per_system in ratios.items():
            for system, seconds in this_round.items():
                same = f"{base}@{split_optimizer(system, cfg.optimizer)[1]}"  # `zero2@muon` against `ddp@muon`
                reference = same if same in this_round else base
                if reference in this_round:
                    per_system[system].append(seconds / this_round[reference])
    results = []
    for system in cfg.systems:
        runs = samples[system]
        med = lambda name: statistics.median(x for s in runs for x in getattr(s, name))  # noqa: E731
        ratio = lambda base: statistics.median(ratios[base][system]) if ratios[base][system] else None  # noqa: E731
        results.append(SystemResult(
            system, med("step_s"), ratio("ddp"), ratio(cfg.baseline),
            med("forward_s"), med("backward_s"), med("optimizer_s"),
            max(s.peak_rss_mib for s in runs), runs[-1].model_state_mib, runs[-1].final_loss, runs[-1].live_mib,
            statistics.median(s.link_bytes for s in runs) / 1e6 if runs[0].link_bytes is not None else None,
            _median_profile(runs), runs[0].first_step_s,
            statistics.median(s.first_step_s for s in runs[1:]) if len(runs) > 1 else None, runs[0].dynamo))
    return results


def _median_profile(runs: list[Sample]) -> dict[str, float] | None:
    profiles = [s.profile for s in runs if s.profile]
    names = {name for p in profiles for name in p}
    return {name: statistics.median(p.get(name, 0.0) for p in profiles) for name in sorted(names)} or None


def ideal_link_mb(system: str, params: int, nodes: int) -> float:
    """MB a node must send per step when every byte crosses the link once: gradients reduced once and
    parameters gathered once (all-reduce-like traffic), twice for stage 3 (forward and backward), each
    (n-1)/n of the model, in fp32, or in int8 (plus a scale per 2048) where the system quantizes it;
    with hpZ stage 3's backward gathers stay within the node, so its parameters cross once."""
    int8 = 1 / 4 + 1 / 2048
    gradients = int8 if system.endswith(("-qgz", "-zpp")) else 1.0
    twice = system.startswith(("zero3", "fsdp2", "deepspeed3")) and not system.endswith("-hpz")
    gathers = (2 if twice else 1) * (int8 if system.endswith("-zpp")
                                                                                       else 1.0)
    return (gradients + gathers) * (nodes - 1) / nodes * params * 4 / 1e6


def as_json(cfg: StepBenchConfig, results: list[SystemResult], links: Sequence[Any] = ()) -> dict[str, Any]:
    return {"config": asdict(cfg), "results": [asdict(r) for r in results], "links": [asdict(x) for x in links]}


# left out first where the table is wider than the terminal (zerorun/tables.py): the ratios and step time stay
DROP = ("live tensors MiB/rank (+% over states)", "model states MiB/rank", "compiled: graphs, breaks", "final loss",
        "forward", "backward", "optimizer", "peak RSS MiB/rank")


def render(cfg: StepBenchConfig, results: list[SystemResult], links: Sequence[Any] = (), width: int | None = None
           ) -> Any:
    """A rich table of the results (with each link's measured throughput on an emulated cluster), fitted to
    `width` columns where given."""
    from zerorun import tables

    m = cfg.model
    params = sum(p.numel() for p in GPT(m).parameters()) if m.d_model <= 2048 else 0
    where = f"{cfg.world_size} ranks"
    if cfg.cluster:
        measured = ", ".join(f"{x.source}->{x.destination} {x.gbit_s:.2f}" for x in links)
        where = f"{cfg.cluster[0]} nodes x {cfg.cluster[1]} ranks, link {cfg.link} (measured Gbit/s: {measured})"
    table = tables.compact(f"step time: GPT {m.layers}L d{m.d_model} h{m.heads} vocab {m.vocab} seq {m.seq_len}"
                           f" ({params / 1e6:.1f}M params), micro-batch {cfg.micro_batch}, {cfg.precision}, "
                           f"{cfg.optimizer}, {where} x {cfg.threads} thread(s), {cfg.rounds} interleaved rounds"
                           + (f"; zerorun with {', '.join(cfg.overrides)}" if cfg.overrides else ""))
    baseline = [f"x {cfg.baseline}"] if cfg.baseline != "ddp" else []
    link = ["node 0 sent MB/step (ideal)"] if cfg.cluster else []
    compiled = any(r.dynamo is not None for r in results)
    warm_up = ["warm-up s: round 1 / later", "compiled: graphs, breaks"] if compiled else []
    for col in ("system", "x DDP", *baseline, "step s", "forward", "backward", "optimizer", *link, *warm_up,
                "model states MiB/rank", "live tensors MiB/rank (+% over states)", "peak RSS MiB/rank", "final loss"):
        table.add_column(col, justify="left" if col == "system" else "right", overflow="fold")
    ratio = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
    for r in results:
        ratios = [ratio(r.ratio_to_ddp)] + ([ratio(r.ratio_to_baseline)] if baseline else [])
        sent = ([f"{r.link_mb:.0f} ({ideal_link_mb(split_optimizer(r.system, '')[0], params, cfg.cluster[0]):.0f})"
                 if r.link_mb is not None else "-"] if cfg.cluster else [])  # T_NS's row ran off the cluster
        later = f"{r.later_first_step_s:.1f}" if r.later_first_step_s is not None else "-"
        first = [f"{r.first_step_s or 0:.1f} / {later}", r.dynamo or "-"] if compiled else []
        table.add_row(describe(r.system, cfg.optimizer), *ratios,
                      f"{r.step_s:.3f}", f"{r.forward_s:.3f}", f"{r.backward_s:.3f}", f"{r.optimizer_s:.3f}", *sent,
                      *first,
                      f"{r.model_state_mib:.0f}", _live(r), f"{r.peak_rss_mib:.0f}", f"{r.final_loss:.4f}")
    return tables.fitted(table, width, DROP, "--json FILE")


def _live(r: SystemResult) -> str:
    if r.live_mib is None:
        return "-"
    return f"{r.live_mib:.0f} (+{100 * (r.live_mib / r.model_state_mib - 1):.1f}%)"
