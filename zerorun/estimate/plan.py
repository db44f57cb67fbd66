"""The memory planner behind `zerorun estimate`: bytes per GPU, CPU and NVMe for every stage and offload.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", section 5): with Psi parameters, N data-parallel ranks and K
bytes of optimizer state per parameter (K = 12 for mixed-precision Adam: fp32 master, momentum,
variance), stage 0 holds (2 + 2 + K) Psi, stage 1 4 Psi + K Psi/N, stage 2 2 Psi + (2 + K) Psi/N,
stage 3 (4 + K) Psi/N. The paper's gradients are 2 bytes; ours are accumulated in fp32 (see
`runtime/precision.py`), so `model_states()` below is what `Engine.memory()` measures and
`paper_model_states()` is the paper's figure, kept for comparison. K depends on the optimizer
(`optimizer_state()`: SGD's momentum 4 bytes a parameter, Adafactor's factored moments next to nothing
for a matrix, Muon's momentum 4 for its matrices beside AdamW's 8 for the rest); "moments" below is
that state, whatever the optimizer keeps.

Everything here is pure arithmetic on integers; `shape_of()` is the one place that looks at a
module (built on the meta device, so no memory is touched).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerorun.errors import ZerorunError
from zerorun.runtime.offload.placement import Place

GIB = 2**30
MIB = 2**20
PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAM_K = 12  # bytes per parameter of mixed-precision Adam's state: fp32 master (4) + two moments (8)
# fp32 bytes of optimizer state per parameter, beside the master (the recipe's optimizer.type names): per parameter
# of any shape, and (where it differs) per parameter of a matrix (2-D or more); Adafactor also keeps 4 bytes per
# row and per column of each matrix (`ModelShape.matrix_edges`)
STATE_BYTES = {"adamw": (8, 8), "adam": (8, 8), "lamb": (8, 8), "sgd": (4, 4), "lion": (4, 4), "adagrad": (4, 4),
               "rmsprop": (4, 4), "adafactor": (4, 0), "muon": (8, 4)}
UNDER_THE_BACKWARD = ("adamw", "adam", "lamb", "adafactor", "muon")  # zero.overlap_optimizer's: not the elementwise
OFFLOADS = ("none", "cpu", "nvme")
BUILT_ON = {  # where a script builds its model: the GPU bytes it takes before zerorun.initialize
    "auto": "whole, in fp32, on the GPU at stages 0-2 and sharded at stage 3, as a model that needs stage 3 is built "
            "(zerorun.sharded_init, or from_pretrained under stage 3)",
    "device": "whole, in fp32, on the GPU (recipes/train_gpt.py; `with torch.device('cuda'):`)",
    "host": "in host memory: the engine copies it to the GPU a unit at a time",
    "meta": "under zerorun.sharded_init (stage 3) or on the meta device: never whole anywhere",
}
HEADROOM = 0.9  # the share of a GPU the recommendation may plan for: the rest is the CUDA context and fragmentation


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model, in elements."""

    params: int  # trainable parameters (Psi)
    largest_unit: int = 0  # stage 3: the largest module unit gathered at once (a transformer block)
    root: int = 0  # stage 3: parameters outside every unit (shared ones, small modules), gathered for the whole pass
    persistent: int = 0  # stage 3: parameters under zero.param_persistence_threshold, kept whole
    matrices: int | None = None  # elements of 2-D (or more) parameters (None: all of them, as in a transformer)
    matrix_edges: int = 0  # rows plus columns over those matrices (Adafactor's factored moments)
    # stage 3: split units (an embedding, a head) of one sharded parameter, and of one Muon takes: run on whole
    # parameters their gather goes one way, so they stay gathered from their forward to their backward
    lone_split: int = 0
    lone_muon_split: int = 0


@dataclass(frozen=True)
class Activations:
    """A transformer's activation shape; all four known or the activations are not estimated."""

    micro_batch: int
    seq_len: int
    hidden: int
    layers: int


@dataclass(frozen=True)
class Settings:
    """The recipe keys the estimate depends on (defaults: `config.ZeroConfig`'s)."""

    precision: str = "fp32"
    bucket_mb: float = 25.0
    allgather_bucket_mb: float = 25.0
    prefetch_units: int | str = "auto"  # zero.prefetch_units: auto is 2 with an optimizer run on whole parameters
    checkpointing: bool = False
    offload_buffer_mb: float = 64.0  # zero.offload_optimizer.buffer_mb
    async_checkpoints: bool = True  # checkpoint.async_save: a host snapshot of the rank's state between saves
    hpz_partition_size: int = 1  # zero.hpz_partition_size: stage 3 keeps 1/hpz of the model per rank besides its shard
    quantized_weights: bool = False  # zero.quantized_weights: stages 1/2 in fp32 keep their master apart
    overlap_optimizer: Any = "auto"  # zero.overlap_optimizer: a backup of the host optimizer state (optim/overlap.py)
    host_share: float = 1.0  # zero.offload_optimizer_ratio: the share of an offloaded (cpu) optimizer on the host
    built_on: str = "auto"  # where the script builds its model before zerorun.initialize (BUILT_ON)
    optimizer: str = "adamw"  # optimizer.type: what its state costs (STATE_BYTES)


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gib: float | None = None
    cpu_mem_gib: float | None = None  # per node

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Footprint:
    """Bytes of one configuration: per GPU by kind, and per node on CPU and NVMe."""

    stage: int
    offload_optimizer: str
    offload_param: str
    gpu: dict[str, int] = field(default_factory=dict)  # params, grads, master, moments, buffers, activations
    cpu_per_rank: int = 0
    nvme_per_rank: int = 0
    snapshot_per_rank: int = 0  # host memory a background checkpoint keeps on a rank that holds one
    snapshot_per_node: int = 0  # ... on the node holding the most (stage 0: rank 0's alone); counted in `fits`
    gpu_setup: int = 0  # per GPU inside zerorun.initialize: the script's model beside the engine's first buffers
    built_on: str = "device"  # how `gpu_setup` counts the script's model (BUILT_ON, never auto)
    paper_model_states: int = 0  # per GPU, the ZeRO paper's 2-byte-gradient figure (no offload)
    fits: bool | None = None

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def gpu_peak(self) -> int:
        """The most the GPU holds: in training, or at setup when the model was built whole on it."""
        return max(self.gpu_total, self.gpu_setup)

    @property
    def name(self) -> str:
        parts = [f"stage {self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params->{self.offload_param}")
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Formulas


def paper_model_states(psi: float, n: int, stage: int, k: int = ADAM_K) -> float:
    """Bytes of model states per rank as the ZeRO paper counts them (section 5, figure 1).

    2-byte parameters and 2-byte gradients, K bytes of optimizer state: stage 0 (2 + 2 + K) Psi,
    stage 1 (P_os) 4 Psi + K Psi/N, stage 2 (P_os+g) 2 Psi + (2 + K) Psi/N, stage 3 (P_os+g+p)
    (4 + K) Psi/N. The paper's example: Psi = 7.5B, N = 64, K = 12 gives 120, 31.4, 16.6, 1.9 GB.
    """
    sharded = {0: 0, 1: k, 2: 2 + k, 3: 4 + k}[stage]
    return (4 + k - sharded) * psi + sharded * psi / n


def optimizer_state(shape: ModelShape, optimizer: str) -> float:
    """Bytes of the optimizer's own state for the whole model (the master aside), as the engine keeps it: Adam 8 a
    parameter, SGD with momentum, Lion, Adagrad and RMSprop 4, Adafactor 4 for vectors and (rows + columns) x 4 for
    each matrix, Muon 4 for its matrices and its AdamW's 8 for the rest. The owner way (Muon, Adafactor, LAMB)
    keeps it per whole parameter: each rank's share is 1/N within the ownership plan's imbalance."""
    if optimizer not in STATE_BYTES:
        raise ZerorunError(f"--optimizer {optimizer!r}: choose from {', '.join(STATE_BYTES)}.")
    anything, matrix = STATE_BYTES[optimizer]
    matrices = shape.params if shape.matrices is None else shape.matrices
    edges = 4 * shape.matrix_edges if optimizer == "adafactor" else 0
    return anything * (shape.params - matrices) + matrix * matrices + edges


def state_per_param(shape: ModelShape, optimizer: str) -> float:
    """`optimizer_state` per parameter: K - 4 (K = 12 for Adam)."""
    return optimizer_state(shape, optimizer) / shape.params


def model_states(shape: ModelShape, n: int, stage: int, precision: str, optimizer: str = "adamw") -> dict[str, float]:
    """Bytes per rank of params, grads, master and moments, as `Engine.memory()` accounts them.

    Our policy differs from the paper in one place: gradients are accumulated and reduced in fp32
    (4 bytes, not 2) whatever the compute dtype, because bf16 accumulation loses bits on every add.
    With p = 2 (bf16/fp16) that gives 18 Psi / 6 + 12/N / 2 + 16/N bytes per parameter for stages
    0-2 (the paper: 16 / 4 + 12/N / 2 + 14/N). In fp32 the parameters are the master weights
    (no copy): 16 / 8 + 8/N / 4 + 12/N, the paper's figures with p = 4 and K = 8.

    Stage 3 holds only shards at rest: fp32 master 4/N, fp32 gradient shard 4/N and moments 8/N
    (the 2-byte shard is cast from the master when gathered), i.e. (4 + K) Psi/N as in the paper,
    plus the persistent parameters (under `param_persistence_threshold`) kept whole in p bytes.
    Adam's 8 bytes of moments are another optimizer's `optimizer_state` (SGD: 4).
    """
    psi, p, mixed = shape.params, PARAM_BYTES[precision], precision != "fp32"
    state = optimizer_state(shape, optimizer)
    if stage == 3:
        return {"params": p * shape.persistent, "grads": 4 * psi / n, "master": 4 * psi / n, "moments": state / n}
    return {"params": p * psi,
            "grads": 4 * psi / n if stage == 2 else 4 * psi,
            "master": (4 * psi / n if stage >= 1 else 4 * psi) if mixed else 0,
            "moments": state / n if stage >= 1 else state}


def working_buffers(shape: ModelShape, stage: int, settings: Settings) -> float:
    """GPU bytes of communication and gathering buffers, beyond the model states.

    Reduce buckets: two fp32 buckets of `zero.bucket_mb` (one filling while one is reduced, with
    `overlap_comm`). Stage 3 also gathers: the root unit for the whole pass, the split units whose gather goes one
    way from forward to backward (`one_way_splits`), and (2 + prefetch_units) of the largest unit in p bytes: the
    one computing, the ones prefetched, and the one whose gradients are still being reduced (what `test_stage3.py`
    bounds the engine's peak by).
    """
    buffers = 2 * settings.bucket_mb * MIB
    if stage == 3:
        p = PARAM_BYTES[settings.precision]
        buffers += p * (shape.root + one_way_splits(shape, settings) + (2 + units_ahead(settings)) * shape.largest_unit)
    return buffers


def one_way_splits(shape: ModelShape, settings: Settings) -> int:
    """Stage 3: elements of the split units kept gathered from their forward to their backward because their gather
    goes one way (runtime/stage3/param_scheduler.py): those of one matrix the optimizer runs on whole parameters."""
    if settings.optimizer == "muon":
        return shape.lone_muon_split
    return shape.lone_split if settings.optimizer in OWNER_WAY else 0


OWNER_WAY = ("muon", "adafactor", "lamb")  # optimizers the engine runs on whole parameters (the owner way)


def units_ahead(settings: Settings) -> int:
    """`zero.prefetch_units` as the engine resolves it (runtime/stage_setup.py): auto is 2 where the optimizer runs
    on whole parameters, else 1."""
    if settings.prefetch_units != "auto":
        return int(settings.prefetch_units)
    return 2 if settings.optimizer in OWNER_WAY else 1


def activation_bytes(act: Activations, precision: str, checkpointing: bool) -> float:
    """Activation bytes per GPU of a GPT-style transformer with fused (flash) attention.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.1): one layer stores 34 s b h bytes in 16-bit (plus 5 a s^2 b for attention scores,
    which fused attention does not store). We scale by p/2 for fp32. With activation checkpointing
    only each layer's input (s b h p) is kept, plus one layer's full activations while it is recomputed.
    """
    sbh = act.seq_len * act.micro_batch * act.hidden
    per_layer = 34 * sbh * PARAM_BYTES[precision] / 2
    if checkpointing:
        return act.layers * sbh * PARAM_BYTES[precision] + per_layer
    return act.layers * per_layer


def placed_states(shape: ModelShape, n: int, stage: int, precision: str, offload_optimizer: str = "none",
                  offload_param: str = "none", host_share: float = 1.0,
                  optimizer: str = "adamw") -> dict[Place, dict[str, float]]:
    """Model-state bytes per rank by `Place` and kind, as `Engine.memory()` holds them.

    Optimizer offload (`runtime/offload/placement.py`, `runtime/offload/homes.py`) moves the fp32 master and the
    moments (12 Psi/N) to the host or to NVMe; in fp32 the master then becomes a copy (the GPU keeps its parameters). The
    reduced fp32 gradient shard stays on the GPU and is streamed to the CPU tile by tile at the step
    (DeepSpeed moves it to the CPU after every micro-batch instead: 4 Psi/N less GPU memory, one
    PCIe transfer per micro-batch more). Stage 3 then gathers from a p-byte parameter shard, kept
    on the GPU or, with parameter offload, on the host / NVMe. With `offload_optimizer: cpu` and a `host_share`
    below 1 (`zero.offload_optimizer_ratio`), that share of the master and moments is on the host and the rest
    stays on the GPU.
    """
    p, psi = PARAM_BYTES[precision], shape.params
    states = model_states(shape, n, stage, precision, optimizer)
    out: dict[Place, dict[str, float]] = {Place.DEVICE: dict(states), Place.HOST: {}, Place.NVME: {}}
    if offload_optimizer != "none":
        home = out[Place.of_setting(offload_optimizer)]
        share = host_share if offload_optimizer == "cpu" else 1.0
        out[Place.DEVICE]["master"], out[Place.DEVICE]["moments"] = (1 - share) * 4 * psi / n, (1 - share) * states["moments"]
        home["master"], home["moments"] = share * 4 * psi / n, share * states["moments"]
        if stage == 3:
            shard = out[Place.of_setting(offload_param)]
            shard["params"] = shard.get("params", 0) + p * psi / n
    return out


def network_copies(psi: float, n: int, stage: int, settings: Settings) -> float:
    """Bytes of the parameter copies ZeRO++ keeps to spare the link: hpZ's secondary partition (stage 3: the
    model in p bytes / hpz_partition_size, `runtime/stage3/hpz.py`) and, with qwZ on stages 1/2 in fp32, the master
    kept apart from the parameters computed with (4 Psi/N, `runtime/flat_params.py`)."""
    extra = 0.0
    if stage == 3 and settings.hpz_partition_size > 1:
        extra += PARAM_BYTES[settings.precision] * psi / settings.hpz_partition_size
    if stage in (1, 2) and settings.quantized_weights and settings.precision == "fp32" and n > 1:
        extra += 4 * psi / n
    return extra


def setup_bytes(shape: ModelShape, n: int, stage: int, settings: Settings, offload_optimizer: str,
                offload_param: str) -> float:
    """GPU bytes inside `zerorun.initialize`, at their peak: the model as the script built it (`built_on`: 4 Psi in
    fp32 on the GPU, else nothing) beside what the engine allocates before the script's parameters go.

    Stages 0-2 (`runtime/flat_params.py`): the flat parameter buffer (p Psi) and, with the optimizer on the GPU in
    mixed precision, its home (12 Psi/N), then one unit at a time an fp32 copy of it; each unit's parameters are
    released as it is filled. Stage 3 (`runtime/stage3/sharded_params.py`): the home (12 Psi/N on the GPU), the
    compute-dtype shard where it stays on the GPU (p Psi/N), and one unit (fp32 copy and its gathered buffer); the
    script's parameters go at the end. This was what set the GPU's peak in the one-GPU offload runs of docs/gpu.md
    (10 bytes a parameter at stage 2, 6 at stage 3, before the engine filled its buffers a unit at a time).
    """
    psi, p = shape.params, PARAM_BYTES[settings.precision]
    built = 4 * psi if built_on(settings, stage) == "device" else 0
    shards = 1 if stage == 0 else n
    on_device = 1.0 if offload_optimizer == "none" else 1 - settings.host_share if offload_optimizer == "cpu" else 0.0
    k = 4 + state_per_param(shape, settings.optimizer)  # the home: master and the optimizer's flat state
    home = on_device * k * psi / shards if stage == 3 or settings.precision != "fp32" or on_device < 1 else 0
    if stage < 3:
        unit = min(psi, settings.bucket_mb * MIB / 4)
        return built + p * psi + home + 4 * unit
    shard = p * psi / n if offload_param == "none" else 0
    return built + home + shard + (4 + p) * (shape.largest_unit or shape.root)


def built_on(settings: Settings, stage: int) -> str:
    """Where the setup counts the model built: the setting, or with `auto` how a model that needs the stage is built
    (a model needing stage 3 does not fit whole on one GPU: `zerorun.sharded_init` and a Hugging Face
    `from_pretrained` under stage 3 build it a shard per rank; below stage 3 scripts build it whole on the GPU)."""
    if settings.built_on != "auto":
        return settings.built_on
    return "meta" if stage == 3 else "device"


def overlap_backup(shape: ModelShape, settings: Settings, n: int, offload: str, host: float, cluster: Cluster) -> float:
    """Host bytes of the backup under the backward (`runtime/optim/overlap.py`: the master and the optimizer state of
    a rank's elements, once more) where it is on; auto: where 12 bytes an element (the engine's bound for any
    optimizer) fit in half the host memory left to each rank, as the engine decides."""
    from zerorun.runtime.optim.overlap import BACKUP_SHARE

    state_numel = settings.host_share * shape.params / n if settings.optimizer in UNDER_THE_BACKWARD else 0.0
    backup = state_numel * (4 + optimizer_state(shape, settings.optimizer) / shape.params)
    if offload != "cpu" or settings.overlap_optimizer is False:
        return 0.0
    if settings.overlap_optimizer == "auto" and cluster.cpu_mem_gib is not None:
        left = cluster.cpu_mem_gib * GIB / cluster.gpus_per_node - host
        return backup if 12 * state_numel <= BACKUP_SHARE * left else 0.0
    return backup


def offload_buffers(settings: Settings, offload_optimizer: str, gpu: bool = True) -> float:
    """Host bytes of offload staging: two gradient and two update tiles of `offload_buffer_mb`
    (pinned), one of each on a CPU-only machine, plus the NVMe store's ring of master + moment tiles."""
    from zerorun.runtime.offload.nvme import RING_SLOTS
    from zerorun.runtime.offload.transfers import StagingRing

    if offload_optimizer == "none":
        return 0.0
    tile = settings.offload_buffer_mb * MIB
    staging = 2 * StagingRing.default_slots(gpu) * tile  # gradients down, updates up
    return staging + (RING_SLOTS * 3 * tile if offload_optimizer == "nvme" else 0)


def checkpoint_snapshot(psi: float, n: int, stage: int, offload_optimizer: str, k: float = ADAM_K) -> int:
    """Host bytes of a background checkpoint's snapshot on the rank holding the most state: the fp32
    master and optimizer state of its shard (`k` bytes a parameter; stage 0: all of them, on rank 0), or one chunk
    when they stream from NVMe."""
    from zerorun.runtime.checkpoint.snapshot import snapshot_bytes

    numel = int(psi) if stage == 0 else -(-int(psi) // n)
    return snapshot_bytes([numel], streamed=True) if offload_optimizer == "nvme" else round(k * numel)


def snapshot_holders_per_node(stage: int, gpus_per_node: int) -> int:
    """Ranks of one node that keep a checkpoint snapshot: every rank its shard's, but at stage 0 only
    rank 0 holds state to save (`runtime/checkpoint/snapshot.py`'s `RankState` for the others)."""
    return 1 if stage == 0 else gpus_per_node


def place(shape: ModelShape, cluster: Cluster, settings: Settings, stage: int, offload_optimizer: str,
          offload_param: str, activations: Activations | None) -> Footprint:
    """One configuration's bytes: model states split between GPU, CPU and NVMe (per rank), plus the
    GPU's working buffers and activations and the host's offload staging."""
    n, psi = cluster.world, shape.params
    placed = placed_states(shape, n, stage, settings.precision, offload_optimizer, offload_param, settings.host_share,
                           settings.optimizer)
    out = Footprint(stage, offload_optimizer, offload_param,
                    paper_model_states=round(paper_model_states(psi, n, stage)))
    gpu = dict(placed[Place.DEVICE])
    gpu["params"] = gpu.get("params", 0) + network_copies(psi, n, stage, settings)
    gpu["buffers"] = working_buffers(shape, stage, settings)
    gpu["activations"] = activation_bytes(activations, settings.precision, settings.checkpointing) if activations else 0
    out.gpu = {k: round(v) for k, v in gpu.items()}
    host = sum(placed[Place.HOST].values()) + offload_buffers(settings, offload_optimizer)
    out.cpu_per_rank = round(host + overlap_backup(shape, settings, n, offload_optimizer, host, cluster))
    out.gpu_setup = round(setup_bytes(shape, n, stage, settings, offload_optimizer, offload_param))
    out.built_on = built_on(settings, stage)
    out.nvme_per_rank = round(sum(placed[Place.NVME].values()))
    if settings.async_checkpoints:
        out.snapshot_per_rank = checkpoint_snapshot(psi, n, stage, offload_optimizer,
                                                    4 + state_per_param(shape, settings.optimizer))
        out.snapshot_per_node = out.snapshot_per_rank * snapshot_holders_per_node(stage, cluster.gpus_per_node)
    per_node = out.cpu_per_rank * cluster.gpus_per_node + out.snapshot_per_node
    if cluster.gpu_mem_gib is not None:
        out.fits = out.gpu_peak <= cluster.gpu_mem_gib * GIB and (
            cluster.cpu_mem_gib is None or per_node <= cluster.cpu_mem_gib * GIB)
    return out


def configurations() -> list[tuple[int, str, str]]:
    """(stage, optimizer offload, param offload), fastest first: least offload, then lowest stage.

    Offload costs more than sharding (PCIe or NVMe against NVLink/network), so any configuration
    without it comes first; param offload only exists for stage 3 and only to a tier no faster than
    the optimizer's (the parameters are needed more often).
    """
    rows = [(0, "none", "none")] + [(s, o, "none") for s in (1, 2) for o in OFFLOADS]
    rows += [(3, o, pr) for o in OFFLOADS for pr in OFFLOADS if OFFLOADS.index(pr) <= OFFLOADS.index(o)]
    cost = {("none", "none"): 0, ("cpu", "none"): 1, ("cpu", "cpu"): 2, ("nvme", "none"): 3, ("nvme", "cpu"): 4,
            ("nvme", "nvme"): 5}
    return sorted(rows, key=lambda r: (cost[(r[1], r[2])], r[0]))


@dataclass
class Estimate:
    shape: ModelShape
    cluster: Cluster
    settings: Settings
    activations: Activations | None
    rows: list[Footprint]
    notes: list[str]

    @property
    def recommended(self) -> Footprint | None:
        """The fastest configuration that fits with `HEADROOM` to spare; else the fastest that fits at all."""
        fitting = [r for r in self.rows if r.fits]
        return next((r for r in fitting if not self.tight(r)), fitting[0] if fitting else None)

    def tight(self, row: Footprint) -> bool:
        """More than `HEADROOM` of the GPU: the CUDA context, fragmentation and any uncounted activations
        may not fit in what is left."""
        return self.cluster.gpu_mem_gib is not None and row.gpu_peak > HEADROOM * self.cluster.gpu_mem_gib * GIB


def estimate(shape: ModelShape, cluster: Cluster, settings: Settings = Settings(),
             activations: Activations | None = None) -> Estimate:
    """Every configuration's placement, fastest first, with the first that fits as the recommendation."""
    if shape.params <= 0:
        raise ZerorunError("estimate: the model has no trainable parameters.")
    if settings.precision not in PARAM_BYTES:
        raise ZerorunError(f"--precision: {settings.precision!r}; choose from {', '.join(PARAM_BYTES)}.")
    if cluster.nodes < 1 or cluster.gpus_per_node < 1:
        raise ZerorunError("--nodes and --gpus-per-node must be at least 1.")
    notes = []
    if shape.largest_unit == 0:
        notes.append("stage 3's gather window is not counted: give --largest-layer (or --hidden, or a --model).")
    if activations is None:
        notes.append("activations are not counted: give --micro-batch, --seq-len, --hidden and --layers.")
    if settings.built_on not in BUILT_ON:
        raise ZerorunError(f"--built-on: {settings.built_on!r}; choose from {', '.join(BUILT_ON)}.")
    notes.append(f"setup counts the model built {BUILT_ON[settings.built_on]} (the \"built\" column; --built-on "
                 f"{'/'.join(b for b in BUILT_ON if b != settings.built_on)} otherwise).")
    rows = [place(shape, cluster, settings, *row, activations) for row in configurations()]
    return Estimate(shape, cluster, settings, activations, rows, notes)
