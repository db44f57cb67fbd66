"""What `zerorun bench step` is asked and what it measures: its configuration, a (round, system) sample, a
system's medians; and how a row names its optimizer (`zero2@muon`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from zerorun.bench.shape import GPTConfig

DEFAULT_SYSTEMS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
NS_REFERENCE = "muon-ns"  # not a system: torch's Muon.step() over the Muon matrices alone, in one process (T_NS)


@dataclass
class StepBenchConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    micro_batch: int = 2
    world_size: int = 2
    threads: int = 1
    rounds: int = 3
    warmup: int = 1
    steps: int = 3
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    precision: str = "fp32"
    nvme_path: str | None = None  # for the *-nvme systems
    baseline: str = "ddp"  # a second ratio column against this system (one of `systems`)
    cluster: tuple[int, int] | None = None  # (nodes, ranks per node) on an emulated cluster; None: local ranks
    link: str = "1gbit"  # the emulated cluster's link rate
    optimizer: str = "adamw"  # every system's optimizer, as the recipe's optimizer.type names it (sgd: momentum 0.9)
    overrides: tuple[str, ...] = ()  # recipe keys (KEY=VALUE) every zerorun system runs with, after its own


@dataclass
class Sample:
    """One (round, system) run on rank 0: per-step phase times and memory."""

    step_s: list[float]
    forward_s: list[float]
    backward_s: list[float]
    optimizer_s: list[float]
    peak_rss_mib: float
    model_state_mib: float
    final_loss: float
    live_mib: float | None  # every live tensor after a backward (None for DDP: its buckets live in C++)
    link_bytes: float | None = None  # per timed step, sent by rank 0's node on its link (emulated cluster only)
    profile: dict[str, float] | None = None  # per timed step: CPU by thread and waits per collective (step_profile)
    first_step_s: float = 0.0  # the warm-up steps: with a compiled model, the compile happens here
    dynamo: str | None = None  # a compiled system's graphs, breaks and frames left eager (compiling.py)


@dataclass
class SystemResult:
    system: str
    step_s: float
    ratio_to_ddp: float | None
    ratio_to_baseline: float | None
    forward_s: float
    backward_s: float
    optimizer_s: float
    peak_rss_mib: float
    model_state_mib: float
    final_loss: float
    live_mib: float | None  # every live tensor after a backward (see `live_tensor_bytes`)
    link_mb: float | None = None  # per step, sent by rank 0's node on its link (median; emulated cluster only)
    profile: dict[str, float] | None = None  # per step, medians of the rounds' (step_profile.py)
    first_step_s: float | None = None  # the warm-up steps of the first round: a compiled system compiles in them
    later_first_step_s: float | None = None  # ... of the later rounds (median): inductor's cache is warm by then
    dynamo: str | None = None  # a compiled system's graphs, breaks and frames left eager (first round's)


def split_optimizer(system: str, default: str) -> tuple[str, str]:
    """`zero2@muon` -> ("zero2", "muon"); a system without one runs `default` (the bench's --optimizer)."""
    base, _, optimizer = system.partition("@")
    return base, optimizer or default
