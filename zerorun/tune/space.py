"""The tuner's candidate space and its pruning: pure functions over the recipe and `zerorun.estimate`.

A candidate is one way to run the user's job: ZeRO stage x optimizer/parameter offload x
micro-batch (with the accumulation that keeps the global batch) x activation checkpointing (only
where the script honours it) x gradient bucket size. `space()` lists every candidate, in the order
expected to be fastest first; `prune()` rejects, before anything runs, those the estimate proves
cannot fit the memory budget (a lower bound: the estimate leaves out the process's own baseline,
so "fits" here only means "worth measuring") and the NVMe ones without a directory to use.

Nothing here starts a process or reads a clock; `script_honours()` reads the script's text.
"""

from __future__ import annotations

import ast
import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path

from zerorun import estimate
from zerorun.config import Recipe
from zerorun.errors import ZerorunError

GIB = 2**30
CHECKPOINTING_KEY = "train.activation_checkpointing"
SCRIPT_KEYS = (CHECKPOINTING_KEY,)  # keys a script applies itself, which it must declare to be tuned
HONOURS_NAME = "ZERORUN_HONOURS"  # the script's declaration: ZERORUN_HONOURS = ["train.activation_checkpointing"]
MAX_MICRO_BATCHES = 8


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration of the job; the fields are the recipe keys the tuner may change."""

    stage: int  # zero.stage
    offload_optimizer: str  # zero.offload_optimizer.device
    offload_param: str  # zero.offload_param.device
    micro_batch: int  # train.micro_batch_size
    grad_accum: int  # train.grad_accum_steps
    checkpointing: bool  # train.activation_checkpointing
    bucket_mb: float  # zero.bucket_mb
    host_share: float = 1.0  # zero.offload_optimizer_ratio (optimizer offloaded to the host: its share there)

    @property
    def sharding(self) -> tuple[int, str, str]:
        return self.stage, self.offload_optimizer, self.offload_param

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    def sharding_label(self) -> str:
        """`stage 3, optimizer->cpu, params->cpu`, as `zerorun estimate` names it."""
        return estimate.Footprint(*self.sharding).name

    def label(self) -> str:
        """`stage 3, optimizer->cpu, params->cpu, micro 4 x 2, ckpt, bucket 25`: one table cell."""
        parts = [self.sharding_label() + (f" ({self.host_share:.0%} on the host)" if self.host_share < 1 else ""),
                 f"micro {self.micro_batch} x {self.grad_accum}"]
        if self.checkpointing:
            parts.append("ckpt")
        parts.append(f"bucket {self.bucket_mb:g}")
        return ", ".join(parts)

    def settings(self) -> dict[str, object]:
        """The recipe keys this candidate sets (dotted key -> value)."""
        return {"zero.stage": self.stage, "zero.offload_optimizer.device": self.offload_optimizer,
                "zero.offload_param.device": self.offload_param, "train.micro_batch_size": self.micro_batch,
                "train.grad_accum_steps": self.grad_accum, CHECKPOINTING_KEY: self.checkpointing,
                "zero.bucket_mb": self.bucket_mb, "zero.offload_optimizer_ratio": self.host_share}


def base_candidate(recipe: Recipe) -> Candidate:
    """The configuration the user's recipe already has."""
    zero, train = recipe.zero, recipe.train
    return Candidate(zero.stage, zero.offload_optimizer.device, zero.offload_param.device, train.micro_batch_size,
                     train.grad_accum_steps, train.activation_checkpointing, zero.bucket_mb,
                     zero.offload_optimizer_ratio)


@dataclass(frozen=True)
class Dimensions:
    """The values each knob may take."""

    shardings: tuple[tuple[int, str, str], ...]  # (stage, optimizer offload, param offload), fastest first
    micro_batches: tuple[tuple[int, int], ...]  # (micro-batch, accumulation)
    checkpointing: tuple[bool, ...]
    bucket_mb: tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.shardings) * len(self.micro_batches) * len(self.checkpointing) * len(self.bucket_mb)


def shardings(stages: tuple[int, ...] = (0, 1, 2, 3), offloads: tuple[str, ...] = estimate.OFFLOADS
              ) -> tuple[tuple[int, str, str], ...]:
    """`estimate.configurations()` (least offload first, then lowest stage) restricted to the given values."""
    return tuple(c for c in estimate.configurations()
                 if c[0] in stages and c[1] in offloads and c[2] in offloads)


def micro_batches(micro: int, accum: int, allow_batch_change: bool = False,
                  explicit: tuple[int, ...] = ()) -> tuple[tuple[int, int], ...]:
    """(micro-batch, accumulation) pairs to try, the recipe's first.

    The global batch (micro x accumulation x ranks) stays the recipe's: each micro-batch divides the
    per-rank batch and the accumulation makes up the rest, so every candidate trains the same thing.
    With `allow_batch_change` the accumulation stays and the micro-batch ranges over a quarter to four
    times the recipe's. `explicit` micro-batches replace that choice (each must divide the per-rank
    batch unless the batch may change).
    """
    per_rank = micro * accum
    if explicit:
        if not allow_batch_change:
            bad = [m for m in explicit if m < 1 or per_rank % m]
            if bad:
                raise ZerorunError(f"--micro-batches: {', '.join(map(str, bad))} do not divide the per-rank batch "
                                   f"{per_rank} (micro-batch {micro} x accumulation {accum}); the global batch stays "
                                   "the recipe's unless you give --allow-batch-change.")
        values = sorted(set(explicit))
    elif allow_batch_change:
        values = sorted({m for m in (micro // 4, micro // 2, micro, micro * 2, micro * 4) if m >= 1})
    else:
        values = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        values = _around(values, micro, MAX_MICRO_BATCHES)
    pairs = [(m, accum if allow_batch_change else per_rank // m) for m in values]
    return ((micro, accum), *[p for p in pairs if p != (micro, accum)])  # the recipe's is always measured


def _around(values: list[int], center: int, count: int) -> list[int]:
    """The `count` values nearest `center` in ratio (a per-rank batch of 1024 has 11 divisors)."""
    return sorted(sorted(values, key=lambda v: (abs(math.log(v / center)), v))[:count])


def bucket_sizes(base: float, explicit: tuple[float, ...] = ()) -> tuple[float, ...]:
    """Gradient bucket sizes, MiB, the recipe's first: by default a quarter of it and four times it too."""
    values = explicit or (base / 4, base, base * 4)
    if any(v <= 0 for v in values):
        raise ZerorunError(f"--bucket-mb: sizes must be > 0, got {', '.join(f'{v:g}' for v in values)}.")
    return (base, *sorted(v for v in set(values) if v != base))  # the recipe's is always measured


def space(dims: Dimensions) -> list[Candidate]:
    """Every candidate, fastest expected first: sharding order, then larger micro-batches, no checkpointing,
    then bucket sizes in the order given."""
    micro = sorted(dims.micro_batches, key=lambda p: -p[0])
    ckpt = sorted(dims.checkpointing)  # False first: recomputation only costs time
    return [Candidate(s[0], s[1], s[2], m, a, c, b)
            for s, (m, a), c, b in itertools.product(dims.shardings, micro, ckpt, dims.bucket_mb)]


# ---------------------------------------------------------------------------------------------
# Pruning


@dataclass(frozen=True)
class Budget:
    """Memory a candidate may use, and how the job is laid out."""

    ranks_per_node: int
    nodes: int
    cpu_bytes_per_node: float
    gpu_bytes: float | None = None  # per GPU; None on a CPU-only job (everything lives in host memory)

    @property
    def world(self) -> int:
        return self.ranks_per_node * self.nodes

    @property
    def cpu_bytes_per_rank(self) -> float:
        return self.cpu_bytes_per_node / self.ranks_per_node


@dataclass(frozen=True)
class Rejection:
    """Why a candidate is not run: what was wrong, with the figure that shows it."""

    candidate: Candidate
    reason: str
    need: float | None = None  # the estimate's bytes per rank of the resource that does not fit


def need(candidate: Candidate, shape: estimate.ModelShape, budget: Budget,
         settings: estimate.Settings) -> tuple[float, float]:
    """(device bytes per rank, host bytes per rank) the estimate gives this candidate.

    On a CPU-only job the device is the host: everything the estimate puts on the GPU is host memory too.
    """
    cluster = estimate.Cluster(budget.nodes, budget.ranks_per_node)
    tuned = replace(settings, bucket_mb=candidate.bucket_mb, checkpointing=candidate.checkpointing,
                    host_share=candidate.host_share)
    placed = estimate.place(shape, cluster, tuned, *candidate.sharding, None)
    if budget.gpu_bytes is None:
        return 0.0, float(placed.gpu_total + placed.cpu_per_rank)
    return float(placed.gpu_total), float(placed.cpu_per_rank)


def check(candidate: Candidate, shape: estimate.ModelShape | None, budget: Budget, settings: estimate.Settings,
          nvme_path: str | None) -> Rejection | None:
    """The reason `candidate` cannot run here, or None when it is worth measuring."""
    if candidate.uses_nvme and not nvme_path:
        return Rejection(candidate, "NVMe offload needs --nvme-path (a directory on a fast local disk)")
    if shape is None:
        return None
    device, host = need(candidate, shape, budget, settings)
    if budget.gpu_bytes is not None and device > budget.gpu_bytes:
        return Rejection(candidate, f"estimate {gib(device)} GPU/rank > budget {gib(budget.gpu_bytes)}", device)
    if host > budget.cpu_bytes_per_rank:
        where = "RSS" if budget.gpu_bytes is None else "CPU"
        return Rejection(candidate, f"estimate {gib(host)} {where}/rank > budget {gib(budget.cpu_bytes_per_rank)}",
                         host)
    return None


HOST_SHARES = (0.75, 0.5, 0.25)  # what an optimizer offloaded to a host without room for all of it tries instead


def prune(candidates: list[Candidate], shape: estimate.ModelShape | None, budget: Budget,
          settings: estimate.Settings, nvme_path: str | None) -> tuple[list[Candidate], list[Rejection]]:
    """Split the candidates into those worth measuring and those rejected before any run (with why). An optimizer
    offloaded to a host that cannot hold all of it keeps the largest share that fits there, the rest on the GPU
    (`zero.offload_optimizer_ratio`), where the GPU has the room."""
    kept, rejected = [], []
    for candidate in candidates:
        verdict = check(candidate, shape, budget, settings, nvme_path)
        if verdict is not None and candidate.offload_optimizer == "cpu" and candidate.host_share == 1.0 \
                and budget.gpu_bytes is not None and "CPU/rank" in verdict.reason:
            shared = next((c for c in (replace(candidate, host_share=s) for s in HOST_SHARES)
                           if check(c, shape, budget, settings, nvme_path) is None), None)
            if shared is not None:
                candidate, verdict = shared, None
        if verdict is None:
            kept.append(candidate)
        else:
            rejected.append(verdict)
    return kept, rejected


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


# ---------------------------------------------------------------------------------------------
# What the script honours


def script_honours(script: str | Path) -> tuple[str, ...]:
    """The recipe keys a training script declares it applies itself: its top-level `ZERORUN_HONOURS` list.

    zerorun cannot see whether a script reads `train.activation_checkpointing`, and measuring a knob
    the script ignores would rank noise. So the tuner varies such a key only when the script says,
    in a literal read without running it:

        ZERORUN_HONOURS = ["train.activation_checkpointing"]
    """
    path = Path(script)
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return ()  # the trial will report the script's own error
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not any(isinstance(t, ast.Name) and t.id == HONOURS_NAME for t in targets) or value is None:
            continue
        try:
            keys = ast.literal_eval(value)
        except ValueError:
            keys = None
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise ZerorunError(f"{path}:{node.lineno}: {HONOURS_NAME} must be a literal list of recipe keys, "
                               f"e.g. {HONOURS_NAME} = [\"{CHECKPOINTING_KEY}\"].")
        unknown = [k for k in keys if k not in SCRIPT_KEYS]
        if unknown:
            raise ZerorunError(f"{path}:{node.lineno}: {HONOURS_NAME}: {', '.join(unknown)} is not a key a script "
                               f"applies itself; choose from {', '.join(SCRIPT_KEYS)}.")
        return tuple(keys)
    return ()
