"""`zerorun bench step`'s options checked and turned into what the benchmark runs: the systems (`--systems`,
`--compile`), a row per optimizer (`--optimizer`), the recipe keys every zerorun system adds (`--set`); and the
run itself, on local processes or on an emulated cluster. Kept apart from `cli/bench.py`, the command group.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import typer

from zerorun.errors import ZerorunError

if TYPE_CHECKING:
    from zerorun.bench.step import StepBenchConfig, SystemResult

# what a system's own name, or another of bench step's options, already sets: --set may not contradict them
_OWN_OPTIONS = {"precision.dtype": "--precision", "optimizer.type": "--optimizer", "optimizer.lr": "--optimizer",
                "optimizer.momentum": "--optimizer", "name": "the benchmark"}


def zero_overrides(sets: list[str], chosen: tuple[str, ...]) -> tuple[str, ...]:
    """`--set KEY=VALUE ...`: recipe keys every zerorun system of `chosen` runs with, after its own. Refused where
    no zerorun system runs, where a key is no recipe key or its value not one the key takes (the recipe's own
    message, under the option's name), and where it would change what a system's name or another option says
    (`--set zero.stage=2` beside zero3)."""
    from zerorun import config
    from zerorun.bench import compiling, step, step_results

    sets = [s.strip() for s in sets if s.strip()]
    if not sets:
        return ()
    bases = {compiling.split_system(step_results.split_optimizer(s, "")[0])[0] for s in chosen}
    zero = sorted(b for b in bases if b in step.ZERO_SYSTEMS)
    if not zero:
        raise ZerorunError("--set: the recipe keys apply to zerorun's systems (zero0-3 and their variants), and none "
                           f"is among --systems ({', '.join(chosen)}).")
    for item in sets:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ZerorunError(f"--set {item}: expected KEY=VALUE, a recipe key in dotted form (e.g. "
                               "zero.prefetch_units=2).")
        key = key.strip()
        if key in _OWN_OPTIONS:
            raise ZerorunError(f"--set {item}: {key} is {_OWN_OPTIONS[key]}'s to set.")
        for base in zero:
            own = next((o for o in step.ZERO_SYSTEMS[base] if o.partition("=")[0] == key), None)
            if own is not None:
                raise ZerorunError(f"--set {item}: the system {base} sets {own} itself; choose the system that "
                                   f"runs as you mean (one of {', '.join(step.ZERO_SYSTEMS)}) instead.")
    for base in zero:
        try:
            config.loads("script: bench", "<bench>", [*step.ZERO_SYSTEMS[base], *sets])
        except ZerorunError as exc:
            message = str(exc)  # the recipe names an override by its --set already
            raise ZerorunError(message if message.startswith("--set") else f"--set, with {base}: {message}") from None
    return tuple(sets)


def with_optimizers(chosen: tuple[str, ...], optimizer: str) -> tuple[tuple[str, ...], str]:
    """The systems and the default optimizer for `--optimizer`: with several, a row per system and optimizer
    (SYSTEM@OPT); with muon, T_NS's row too. Unknown names are refused as the recipe refuses them."""
    from zerorun import config
    from zerorun.bench import step

    names = [o.strip() for o in optimizer.split(",") if o.strip()] or ["adamw"]
    for name in names:
        try:
            config.loads("script: bench", "<bench>", [f"optimizer.type={name}"])
        except ZerorunError as exc:
            raise ZerorunError(f"--optimizer {name}: {exc}") from None
    if len(names) > 1:
        baseline_first = [f"{s}@{o}" for s in chosen for o in names]
        chosen = tuple(baseline_first)
    if "muon" in names:
        chosen = (*chosen, step.NS_REFERENCE)
    return chosen, names[0] if len(names) == 1 else ",".join(names)


def step_systems(systems: str, nvme_path: str | None, baseline: str, compile: bool = False) -> tuple[str, ...]:
    """`--systems` as a tuple (with `--compile`, each ddp*/zero* system followed by its compiled twin), refused
    with the option's name when it cannot run as asked."""
    from zerorun.bench import compiling, step

    chosen = tuple(s.strip() for s in systems.split(",") if s.strip())
    if compile:
        chosen = tuple(dict.fromkeys(name for s in chosen for name in (
            (s, f"{s}+compile") if s.startswith(compiling.COMPILED_BASES) and "+" not in s else (s,))))
    bases = [compiling.split_system(s) for s in chosen]
    unknown = [s for s, (base, _) in zip(chosen, bases) if base not in step.SYSTEMS]
    if unknown:
        raise ZerorunError(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(step.SYSTEMS)}, each "
                           f"also as SYSTEM+compile or SYSTEM+compile-blocks (ddp* and zero* only).")
    uncompilable = [s for s, (base, mode) in zip(chosen, bases)
                    if mode and not base.startswith(compiling.COMPILED_BASES)]
    if uncompilable:
        raise ZerorunError(f"--systems: {', '.join(uncompilable)}: only ddp* and zero* systems have compiled rows "
                           "(FSDP2's and DeepSpeed's compile support is theirs to measure).")
    if any(s.endswith("nvme") for s in chosen) and not nvme_path:
        raise ZerorunError("--nvme-path: required by the *-nvme systems (a directory on a real disk, not tmpfs).")
    if baseline != "ddp" and baseline not in chosen:
        raise ZerorunError(f"--baseline: {baseline!r} is not among --systems ({', '.join(chosen)}); add it there "
                           "so both run in the same rounds.")
    if any(s.startswith("deepspeed") for s in chosen) and importlib.util.find_spec("deepspeed") is None:
        raise ZerorunError("--systems: deepspeed2/deepspeed3 need DeepSpeed (pip install deepspeed).")
    return chosen


def run_step_bench(cfg: StepBenchConfig) -> tuple[list[SystemResult], list[Any]]:
    """The step benchmark's results on local processes, or on an emulated cluster (`cfg.cluster`) with its links."""
    from zerorun.bench import step
    from zerorun.bench.cluster import EmulatedCluster, parse_rate

    progress = lambda line: typer.echo(line, err=True)  # noqa: E731
    if cfg.cluster is None:
        return step.run(cfg, progress), []
    from zerorun.bench.cluster_spawn import run_ranks_on

    nodes, per_node = cfg.cluster
    with EmulatedCluster.start(nodes, parse_rate(cfg.link)) as built:
        links = built.measure_links()
        progress("links: " + ", ".join(f"{x.source}->{x.destination} {x.gbit_s:.2f} Gbit/s" for x in links))
        results = step.run(cfg, progress, lambda fn, args: run_ranks_on(built, per_node, fn, args,
                                                                        threads=cfg.threads))
    return results, links
