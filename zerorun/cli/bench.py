"""`zerorun bench ...`: the measurement commands (step time against DDP/FSDP2, collectives, Adam
kernels, NVMe I/O, the largest model), kept apart from `cli/app.py` so each module reads on its own.

Each command imports its benchmark only when run, so `zerorun --help` stays fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from zerorun.bench.shape import BENCHMARK, GPTConfig
from zerorun.cli.bench_balance import bench_balance
from zerorun.cli.counts import count
from zerorun.config.counts import parse_count
from zerorun.errors import ZerorunError

bench_app = typer.Typer(help="Side-by-side measurements: step time against DDP/FSDP2, collectives, Adam kernels, "
                             "NVMe I/O, the largest model this machine trains; and the GPU check.",
                        no_args_is_help=True)
bench_app.command("balance")(bench_balance)

# The benchmark model's options, shared by the commands that build it (defaults: `bench.shape.BENCHMARK`).
Layers = Annotated[int, typer.Option(help="GPT layers.")]
DModel = Annotated[int, typer.Option(help="GPT width.")]
Heads = Annotated[int, typer.Option(help="Attention heads.")]
Vocab = Annotated[int, typer.Option(help="Vocabulary size.")]
SeqLen = Annotated[int, typer.Option(help="Sequence length.")]
MicroBatch = Annotated[int, typer.Option(help="Micro-batch per rank.")]
Ranks = Annotated[int, typer.Option(help="Ranks (local processes, gloo).")]


@bench_app.command("step")
def bench_step(
    layers: Layers = BENCHMARK.layers,
    d_model: DModel = BENCHMARK.d_model,
    heads: Heads = BENCHMARK.heads,
    vocab: Vocab = BENCHMARK.vocab,
    seq_len: SeqLen = BENCHMARK.seq_len,
    micro_batch: MicroBatch = 2,
    ranks: Ranks = 2,
    threads: Annotated[int, typer.Option(help="CPU threads per rank.")] = 1,
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (each system once per round).")] = 3,
    steps: Annotated[int, typer.Option(help="Timed steps per round, after one warm-up step (two with a compiled "
                                                 "system).")] = 3,
    systems: Annotated[str, typer.Option(help="Comma-separated: ddp, ddp-fused, fsdp2, deepspeed2, deepspeed3, "
                                               "zero0-3, zero1-offload, "
                                               "zero2-offload, zero3-offload (CPU), zero2-overlap, zero3-overlap "
                                               "(CPU, stepped under the backward), zero2-nvme, zero3-nvme.")] =
        "ddp,fsdp2,zero1,zero2,zero3",
    precision: Annotated[str, typer.Option(help="fp32, bf16 or fp16 for zerorun's stages.")] = "fp32",
    nvme_path: Annotated[str | None, typer.Option(help="Directory for the *-nvme systems' offload files.")] = None,
    baseline: Annotated[str, typer.Option(help="A second ratio column against this system (one of --systems), "
                                               "e.g. ddp-fused: DDP with AdamW(fused=True), the strong baseline.")] =
        "ddp",
    cluster: Annotated[str | None, typer.Option(help="Run on an emulated cluster of NODESxRANKS (e.g. 2x1): network "
                                                     "namespaces on this machine joined by shaped links (root).")] =
        None,
    link: Annotated[str, typer.Option(help="The emulated cluster's link rate per node, e.g. 1gbit, 10gbit.")] =
        "1gbit",
    compile: Annotated[bool, typer.Option("--compile", help="Add a compiled row after each ddp* and zero* system: "
                                                          "SYSTEM+compile, torch.compile(model) before initialize "
                                                          "(torch.compile(DDP(model)) for DDP). Any system may also be "
                                                          "named so in --systems, or as SYSTEM+compile-blocks "
                                                          "(each block replaced by torch.compile(block)).")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON here.")] = None,
    optimizer: Annotated[str, typer.Option(help="Every system's optimizer, as a recipe's optimizer.type names it "
                                                "(adamw, sgd, lion, muon, ...; sgd with momentum 0.9). Several, "
                                                "comma-separated, give each system a row per optimizer (SYSTEM@OPT); "
                                                "with muon, a row times torch's Muon.step() alone (T_NS).")] = "adamw",
    sets: Annotated[list[str] | None, typer.Option("--set", help="KEY=VALUE, a recipe key every zerorun system runs "
                                                                 "with (repeatable), e.g. zero.prefetch_units=2.")] =
        None,
) -> None:
    """Step time and memory of zerorun's stages against DDP, FSDP2 and DeepSpeed, in one interleaved run."""
    from zerorun import tables
    from zerorun.bench import step, step_muon, step_profile
    from zerorun.bench.cluster import parse_shape
    from zerorun.cli import bench_step

    chosen = bench_step.step_systems(systems, nvme_path, baseline, compile)
    chosen, optimizer = bench_step.with_optimizers(chosen, optimizer)
    overrides = bench_step.zero_overrides(sets or [], chosen)
    shape = parse_shape(cluster) if cluster else None
    # a compiled stage 3 model compiles in its second step (its first pass runs eagerly): every system warms up
    # over two steps then, so that the rows still train on the same batches
    warmup = 2 if any("+" in s for s in chosen) else 1
    cfg = step.StepBenchConfig(GPTConfig(layers, d_model, heads, vocab, seq_len), micro_batch,
                               shape[0] * shape[1] if shape else ranks, threads, rounds, warmup, steps, chosen,
                               precision, nvme_path, baseline, shape, link, optimizer, overrides)
    results, links = bench_step.run_step_bench(cfg)
    out = tables.console()
    out.print(step.render(cfg, results, links, out.width))
    out.print(step_profile.render(results, out.width))
    for line in step_muon.muon_verdicts(cfg, results):
        out.print(line)
    if json_out is not None:
        json_out.write_text(json.dumps(step.as_json(cfg, results, links), indent=2))


@bench_app.command("comm")
def bench_comm(
    sizes: Annotated[str, typer.Option(help="Comma-separated buffer sizes in MiB.")] = "25,100",
    ranks: Annotated[int, typer.Option(help="Ranks (local processes, gloo).")] = 2,
    cluster: Annotated[str | None, typer.Option(help="Across an emulated cluster of NODESxRANKS (e.g. 2x1), "
                                                     "not loopback (root).")] = None,
    link: Annotated[str, typer.Option(help="The emulated cluster's link rate per node.")] = "1gbit",
) -> None:
    """The backend's collectives against the implementations zerorun picks for it."""
    from rich.console import Console

    from zerorun.bench import comm
    from zerorun.bench.cluster import EmulatedCluster, parse_rate, parse_shape

    sizes_mib = [float(s) for s in sizes.split(",") if s.strip()]
    if cluster is None:
        Console(width=200).print(comm.render(comm.run(sizes_mib, ranks), ranks))
        return
    from zerorun.bench.cluster_spawn import run_ranks_on

    (nodes, per_node), rate = parse_shape(cluster), parse_rate(link)
    with EmulatedCluster.start(nodes, rate) as built:
        measured = ", ".join(f"{x.source}->{x.destination} {x.gbit_s:.2f}" for x in built.measure_links())
        results = comm.run(sizes_mib, spawn=lambda fn, args: run_ranks_on(built, per_node, fn, args))
    Console(width=200).print(comm.render(results, nodes * per_node,
                                         where=f" on {cluster} nodes, link {link} (measured Gbit/s: {measured})"))


def _kernel_bench_sizes(sizes: str, bandwidth_size: str, threads: int, repeats: int) -> tuple[list[int], int]:
    """`bench adam`'s and `bench quantize`'s sizes, parsed, and their counts checked."""
    try:
        numels = [parse_count(s) for s in sizes.split(",") if s.strip()]
        bandwidth_numel = parse_count(bandwidth_size)
    except ValueError as exc:
        raise ZerorunError(f"--sizes/--bandwidth-size: {exc}") from None
    if threads < 1 or repeats < 1:
        raise ZerorunError("--threads and --repeats must be at least 1.")
    return numels, bandwidth_numel


@bench_app.command("adam")
def bench_adam(
    sizes: Annotated[str, typer.Option(help="Comma-separated shard sizes in parameters (K/M/B = 10^3/6/9).")] =
        "1M,16M",
    threads: Annotated[int, typer.Option(help="CPU threads (torch's and our kernel's).")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed steps per implementation and size, after one warm-up.")] = 10,
    implementations: Annotated[str, typer.Option(help="Comma-separated subset of: zerorun, zerorun+bf16, "
                                                      "torch fused, torch fused+bf16, torch foreach, "
                                                      "torch for-loop, deepspeed (DeepSpeedCPUAdam, where "
                                                      "deepspeed imports) (default: all).")] = "",
    bandwidth_size: Annotated[str, typer.Option(help="Elements of the torch add that measures memory bandwidth; "
                                                     "make it larger than the last-level cache.")] = "64M",
) -> None:
    """Params/s and GB/s of our CPU Adam kernel and torch's, against the measured memory bandwidth."""
    from rich.console import Console

    from zerorun.bench import adam

    numels, bandwidth_numel = _kernel_bench_sizes(sizes, bandwidth_size, threads, repeats)
    chosen = tuple(s.strip() for s in implementations.split(",") if s.strip()) or adam.IMPLEMENTATIONS
    unknown = [s for s in chosen if s not in adam.IMPLEMENTATIONS]
    if unknown:
        raise ZerorunError(f"--implementations: unknown {', '.join(unknown)}; "
                           f"choose from {', '.join(adam.IMPLEMENTATIONS)}.")
    Console(width=200).print(adam.render(adam.run(numels, threads, repeats, chosen, bandwidth_numel=bandwidth_numel)))


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@bench_app.command("offload")
def bench_offload(
    quick: Annotated[bool, typer.Option(help="A 0.6B GPT, zerorun (overlap on) beside DeepSpeed's stage 2, one "
                                             "round: `zerorun bench gpu`'s side by side.")] = False,
    systems: Annotated[str, typer.Option(help="Comma-separated subset of: zero2-host, zero2-host-overlap, zero3-host, "
                                              "zero3-host-overlap, deepspeed2-offload, deepspeed3-offload.")] = "",
    steps: Annotated[int | None, typer.Option(min=1, help="Timed steps per run (after one warm-up).")] = None,
    rounds: Annotated[int | None, typer.Option(min=1, help="Rounds, interleaving the systems.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON here.")] = None,
) -> None:
    """One-GPU ZeRO-Offload: zerorun's modes beside DeepSpeed's ZeRO-Offload (step, TFLOP/s, MFU, memory, phases)."""
    import dataclasses

    from rich.console import Console

    from zerorun.bench import offload

    chosen = tuple(s.strip() for s in systems.split(",") if s.strip()) or None
    unknown = [s for s in chosen or () if s not in offload.SYSTEMS]
    if unknown:
        raise ZerorunError(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(offload.SYSTEMS)}.")
    cfg = offload.OffloadBenchConfig.default(quick, chosen)
    cfg = dataclasses.replace(cfg, steps=steps or cfg.steps, rounds=rounds or cfg.rounds)
    rows = offload.run(cfg, progress=lambda line: typer.echo(line, err=True))
    Console(width=220).print(offload.render(cfg, rows))
    if json_out is not None:
        json_out.write_text(json.dumps(offload.as_json(cfg, rows), indent=2))
    if all(row.step_s is None for row in rows if row.system in offload.ZERO):
        raise typer.Exit(1)


@bench_app.command("quantize")
def bench_quantize(
    sizes: Annotated[str, typer.Option(help="Comma-separated tensor sizes in elements (K/M/B = 10^3/6/9).")] =
        "1M,16M",
    threads: Annotated[int, typer.Option(help="CPU threads (torch's and our kernel's).")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed calls per operation and size, after one warm-up.")] = 10,
    bandwidth_size: Annotated[str, typer.Option(help="Elements of the torch add that measures memory bandwidth; "
                                                     "make it larger than the last-level cache.")] = "64M",
    device: Annotated[str, typer.Option(help="cpu, or cuda: the CUDA codec against a device-to-device copy.")] = "cpu",
) -> None:
    """GB/s of qwZ/qgZ's block int8 codec, our kernel and torch's path, against the measured memory bandwidth."""
    from rich.console import Console

    from zerorun.bench import quantize

    if device not in ("cpu", "cuda"):
        raise ZerorunError(f"--device: {device!r}; choose cpu or cuda.")
    if device == "cuda" and not torch_cuda_available():
        raise ZerorunError("--device cuda: torch sees no CUDA device here.")
    numels, bandwidth_numel = _kernel_bench_sizes(sizes, bandwidth_size, threads, repeats)
    Console(width=200).print(quantize.render(quantize.run(numels, threads, repeats, bandwidth_numel=bandwidth_numel,
                                                          device=device)))


@bench_app.command("io")
def bench_io(
    path: Annotated[str, typer.Option(help="A directory on the disk to measure (a real disk, not tmpfs).",
                                      show_default=False)],
    size_mb: Annotated[int, typer.Option(help="File size in MiB (rounded up to 8 MiB, dd's block).")] = 1024,
    block_sizes: Annotated[str, typer.Option(help="Comma-separated request chunk sizes (K/M = KiB/MiB).")] = "1M,8M",
    queue_depths: Annotated[str, typer.Option(help="Comma-separated chunks in flight.")] = "1,8,32",
    threads: Annotated[str, typer.Option(help="Comma-separated thread counts (thread-pool backends only).")] = "4",
    backends: Annotated[str, typer.Option(help="Comma-separated subset of: libaio, threads, python.")] =
        "libaio,threads",
    rounds: Annotated[int, typer.Option(help="Interleaved rounds (each case once per round).")] = 3,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON here.")] = None,
) -> None:
    """Read and write GB/s of zerorun's async O_DIRECT I/O next to dd (and fio) on the same disk."""
    from rich.console import Console

    from zerorun.bench import io

    try:
        blocks = [io.parse_bytes(s) for s in block_sizes.split(",") if s.strip()]
        depths = [int(s) for s in queue_depths.split(",") if s.strip()]
        counts = [int(s) for s in threads.split(",") if s.strip()]
    except ValueError as exc:
        raise ZerorunError(f"--block-sizes/--queue-depths/--threads: {exc}") from None
    chosen = [s.strip() for s in backends.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in io.BACKENDS]
    if unknown:
        raise ZerorunError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(io.BACKENDS)}.")
    if size_mb < 1 or rounds < 1 or not blocks or min(depths, default=0) < 1 or min(counts, default=0) < 1:
        raise ZerorunError("--size-mb, --rounds, --queue-depths and --threads must be at least 1.")
    bench = io.run(path, size_mb * 2**20, blocks, depths, counts, chosen, rounds,
                   progress=lambda line: typer.echo(line, err=True))
    Console(width=200).print(io.render(bench))
    if json_out is not None:
        json_out.write_text(json.dumps(io.as_json(bench), indent=2))


@bench_app.command("scale")
def bench_scale(
    systems: Annotated[str, typer.Option(help="Comma-separated subset of: ddp, zero3-cpu, zero3-nvme.")] =
        "ddp,zero3-cpu,zero3-nvme",
    nvme_path: Annotated[str | None, typer.Option(help="Directory for zero3-nvme's files (a real disk).")] = None,
    max_rung: Annotated[int, typer.Option(help="Largest rung of the family to consider.")] = 8,
    max_params: Annotated[int | None, typer.Option(parser=count, metavar="COUNT", help="Consider no model above "
                                                   "this many parameters (e.g. 500M).")] = None,
    ram_gib: Annotated[float | None, typer.Option(help="RAM budget for all ranks (default: 80% of available).")] =
        None,
    disk_gb: Annotated[float | None, typer.Option(help="Disk budget at --nvme-path (default: 80% of free).")] = None,
    steps: Annotated[int, typer.Option(help="Steps per run; the first is untimed.")] = 3,
    base_layers: Annotated[int, typer.Option(help="Family: layers of rung 0.")] = BENCHMARK.layers,
    base_d_model: Annotated[int, typer.Option(help="Family: width of rung 0.")] = BENCHMARK.d_model,
    d_step: Annotated[int, typer.Option(help="Family: width added per rung.")] = 256,
    layer_step: Annotated[int, typer.Option(help="Family: layers added per rung.")] = 2,
    head_dim: Annotated[int, typer.Option(help="Family: width per attention head.")] = BENCHMARK.d_model // BENCHMARK.heads,
    vocab: Annotated[int, typer.Option(help="Family: vocabulary.")] = BENCHMARK.vocab,
    seq_len: Annotated[int, typer.Option(help="Family: sequence length.")] = BENCHMARK.seq_len,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON here.")] = None,
) -> None:
    """The largest GPT of the standard family DDP and stage 3 with CPU / NVMe offload train here: predicted, then run."""
    from rich.console import Console

    from zerorun.bench import scale
    from zerorun.bench.scale_plan import Family

    family = Family(base_layers, base_d_model, d_step, layer_step, head_dim, vocab, seq_len)
    cfg = scale.make_config(systems, max_rung, max_params, ram_gib, disk_gb, nvme_path, steps, family)
    results = scale.run(cfg, progress=lambda line: typer.echo(line, err=True))
    Console(width=240).print(scale.render(cfg, results))
    if json_out is not None:
        json_out.write_text(json.dumps(scale.as_json(cfg, results), indent=2))


@bench_app.command("gpu")
def bench_gpu(
    steps: Annotated[str, typer.Option(help="Comma-separated subset of: environment, build, numerics, bandwidth, "
                                            "pytest, launch, sanitizer, deepspeed (default: all).")] = "",
    out: Annotated[Path, typer.Option(help="Write gpu_check.json here (a directory).")] = Path("runs/bench-gpu"),
    max_numel: Annotated[int, typer.Option(parser=count, metavar="COUNT", help="Skip numerics cases with more "
                                                                               "elements than this (e.g. 100M).")] = 10**12,
    timeout_s: Annotated[float, typer.Option(help="Limit for the CUDA tests and for each launch, seconds.")] = 300.0,
) -> None:
    """Prove a GPU machine: environment, kernel build, numerics, bandwidth, CUDA tests, launches (NCCL and ranks
    sharing the GPU over gloo), the CUDA stream sanitizer, ZeRO-Offload beside DeepSpeed's."""
    import psutil

    from zerorun.bench import gpu

    chosen = tuple(s.strip() for s in steps.split(",") if s.strip()) or gpu.STEPS
    unknown = [s for s in chosen if s not in gpu.STEPS]
    if unknown:
        raise ZerorunError(f"--steps: unknown {', '.join(unknown)}; choose from {', '.join(gpu.STEPS)}.")
    options = gpu.Options(steps=chosen, root=Path.cwd(), max_numel=max_numel, timeout_s=timeout_s)
    results = gpu.run(options, report=lambda r: typer.echo(r.line()))
    # the command's whole time, from the process's start: importing torch and CUDA is part of proving a machine
    typer.echo(gpu.summary(results, time.time() - psutil.Process().create_time()))
    out.mkdir(parents=True, exist_ok=True)
    gpu.write_json(results, out / "gpu_check.json", options.root)
    typer.echo(f"results: {out / 'gpu_check.json'}")
    if any(r.status is gpu.Status.FAIL for r in results):
        raise typer.Exit(1)


@bench_app.command("ckpt")
def bench_ckpt(
    layers: Layers = BENCHMARK.layers,
    d_model: DModel = BENCHMARK.d_model,
    heads: Heads = BENCHMARK.heads,
    vocab: Vocab = BENCHMARK.vocab,
    seq_len: SeqLen = BENCHMARK.seq_len,
    micro_batch: MicroBatch = 2,
    ranks: Ranks = 2,
    stage: Annotated[int, typer.Option(min=0, max=3, help="ZeRO stage.")] = 2,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds; each runs one window of --every steps per mode, in "
                                                    "an order rotated from round to round.")] = 5,
    every: Annotated[int, typer.Option(min=1, help="Save every N optimizer steps.")] = 4,
    modes: Annotated[str, typer.Option(help="Comma-separated: none, sync, async (and async-nice<N>: the writer "
                                            "thread at nice N).")] = "none,sync,async",
    directory: Annotated[str | None, typer.Option("--dir", help="Where checkpoints are written (a fresh "
                                                                 "directory, removed after the run; default "
                                                                 "/var/tmp).")] = None,
    nvme_path: Annotated[str | None, typer.Option(help="Offload the optimizer state to NVMe here.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON here.")] = None,
) -> None:
    """What a checkpoint every N steps costs training: no checkpoint, synchronous and background saves."""
    from rich.console import Console

    from zerorun.bench import ckpt

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = [m for m in chosen if not ckpt.valid_mode(m)]
    if unknown or "none" not in chosen or len(set(chosen)) < len(chosen):
        raise ZerorunError(f"--modes: {'unknown ' + ', '.join(unknown) if unknown else 'none missing or repeated'}; "
                           f"choose from {', '.join(ckpt.MODES)} or async-nice<0-19>, with none (the baseline) "
                           "and each once.")
    if nvme_path is not None and stage == 0:
        raise ZerorunError("--nvme-path: optimizer offload needs --stage 1 or more.")
    cfg = ckpt.CkptBenchConfig(GPTConfig(layers, d_model, heads, vocab, seq_len), micro_batch, ranks, 1, stage, rounds,
                               every, directory or ckpt.default_directory(), nvme_path, chosen)
    result = ckpt.run(cfg, progress=lambda line: typer.echo(line, err=True))
    Console(width=200).print(ckpt.render(cfg, result))
    facts = ckpt.summary(result, chosen)
    for mode, parts in facts["breakdown_s"].items():
        if parts is not None:
            typer.echo(f"{mode}: cost/save {facts['cost_per_save_s'][mode]['median']:.3f} s = " + " + ".join(
                f"{k.replace('_', ' ')} {v:.3f} s" for k, v in parts.items()))
    for mode, figures in facts.get("targets", {}).items():
        typer.echo(f"{mode}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in figures.items()))
    if json_out is not None:
        json_out.write_text(json.dumps(ckpt.as_json(cfg, result), indent=2))
