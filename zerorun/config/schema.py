"""The recipe's schema: typed dataclasses that are the one definition of every key, type, default and range.

Each field's `doc` metadata is its documentation (the reference renderer, `config.reference`, turns it
into docs/recipes.md's table) and its `ge`/`gt`/`le`/`lt` metadata its bounds (the converter,
`config.convert`, enforces them). This module holds data only: reading a file is `config.load`'s.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

BACKEND_ENV = "ZERORUN_BACKEND"  # launch.backend, for every process group a worker (or a test, a bench) makes


def _f(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None, **bounds: float) -> Any:
    """A dataclass field with its documentation and numeric bounds (ge/gt/le/lt) as metadata."""
    meta = {"doc": doc, **bounds}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


OffloadDevice = Literal["none", "cpu", "nvme"]
Dtype = Literal["fp32", "bf16", "fp16"]


@dataclass
class OffloadConfig:
    """Where a kind of model state lives when it is not needed on the device."""

    __shorthand__ = "device"  # `offload_optimizer: cpu` means `offload_optimizer: {device: cpu}`

    device: OffloadDevice = _f("none", "none: stay on the device; cpu: host memory; nvme: files under nvme_path.")
    nvme_path: str | None = _f(None, "Directory for NVMe offload files (required when device is nvme).")
    pin_memory: bool = _f(True, "Pin host buffers for faster copies (only where CUDA exists).")
    buffer_mb: float = _f(64.0, "Size of one tile streamed between places (per buffer of the swap ring), MiB.", gt=0)


@dataclass
class AioConfig:
    """Asynchronous NVMe I/O for offload (O_DIRECT, aligned buffers)."""

    block_size: int = _f(8 * 2**20, "Bytes per I/O request (a multiple of 4096).", ge=4096)
    queue_depth: int = _f(8, "Requests in flight per file operation.", ge=1)
    threads: int = _f(4, "I/O threads (the thread-pool backend; native AIO uses one submitter).", ge=1)
    backend: Literal["auto", "libaio", "threads"] = _f("auto", "auto: Linux native AIO where the kernel allows it, "
                                                               "else a thread pool of pread/pwrite.")


@dataclass
class ZeroConfig:
    """ZeRO partitioning: what is sharded across data-parallel ranks and how it is communicated."""

    stage: int = _f(2, "0: plain data parallel; 1: shard optimizer states; 2: also gradients; 3: also parameters.", ge=0, le=3)
    overlap_comm: bool = _f(True, "Reduce gradient buckets asynchronously while backward continues; after a "
                                  "step, stage 3 starts gathering the next forward's first units.")
    overlap_publish: Literal["auto", True, False] = _f(
        "auto", "Stages 1/2: engine.step() starts the all-gather of the updated buckets and returns; the next forward "
        "waits for each bucket just before the layer that reads it. Faster where the link is the bottleneck, but "
        "code that reads parameters directly after a step (an EMA of the weights, p.data) must call "
        "engine.wait_published() first. auto: on when the ranks span nodes (the all-gather crosses the link), off "
        "on one node; false: every parameter is updated when step() returns.")
    overlap_optimizer: Literal["auto", True, False] = _f(
        "auto", "Stages 1-3 with the optimizer state in host memory (offload_optimizer: cpu): each unit's Adam update "
        "runs on the host as soon as its reduced gradient lands, while the backward goes on, speculatively, and so "
        "does the step of the parameters an optimizer such as Muon, Adafactor or LAMB updates whole (the owner way); "
        "step() checks it (clipping that fires, a non-finite gradient, a learning rate changed in between) and where the "
        "step differs rolls it back exactly and runs it as without. Bit-identical to false; keeps a backup of the "
        "host optimizer state (12 bytes per parameter of the rank's shard). auto: on with offload_optimizer: cpu "
        "beside a GPU, where the backup fits in half the host memory left to each rank (on a CPU-only machine the "
        "backward and the optimizer share the cores: off); true is refused without offload_optimizer: cpu.")
    bucket_mb: float = _f(25.0, "Stages 0-2: size of a gradient reduce(-scatter) bucket, MiB; each bucket is also "
                                "all-gathered as a whole after the step.", gt=0)
    allgather_bucket_mb: float = _f(25.0, "Stage 3: the largest flat buffer a unit's parameters are all-gathered in "
                                          "(its gradients are reduce-scattered in the same pieces), MiB.", gt=0)
    reduce_dtype: Literal["fp32", "bf16"] = _f(
        "fp32", "The dtype gradients are accumulated and reduced across ranks in (DeepSpeed's "
        "data_types.grad_accum_dtype). bf16 halves the gradient bytes sent and held, and rounds every "
        "accumulation and reduction to bf16's 8 significant bits.")
    cpu_collectives: Literal["auto", "shm", "gloo"] = _f(
        "auto", "CPU ranks: auto and shm carry collectives through a shared-memory segment when every rank is on "
        "one host (memory speed; auto falls back to gloo where it cannot, shm refuses); gloo: always the process "
        "group's TCP loopback.")
    quantized_gradients: Literal["auto", True, False] = _f(
        False, "Stages 1-3, ZeRO++'s qgZ: gradients crossing the network (where shared memory cannot carry them: "
        "ranks on other nodes; across nodes only, where the collectives are hierarchical) are sent as int8 in "
        "blocks of 2048 with an fp32 scale each, a quarter of the bytes, and summed in fp32; on gloo and on NCCL. "
        "Changes the numbers slightly (docs/cluster.md measures the loss). auto: on where the link and the codec, "
        "measured at setup, say it pays (it costs more than it saves over a fast link), and says which once.")
    quantized_weights: Literal["auto", True, False] = _f(
        False, "Stages 1-3, ZeRO++'s qwZ: parameters cross the network as int8 in blocks of 2048 with an fp32 "
        "scale each when all-gathered (stage 3: to compute with; stages 1/2: after the step), a quarter of the "
        "bytes; every rank computes with the same dequantized weights, the fp32 masters stay exact (stages 1/2 "
        "in fp32 then keep a master shard apart from the parameters: 4 bytes per parameter / world size). "
        "auto: as for quantized_gradients.")
    host_memory: Literal["fast", "lean"] = _f(
        "fast", "How glibc treats host memory freed in training (stage 3 on CPU re-gathers a unit into the memory "
        "it released either way). fast: freed blocks of up to 32 MiB are kept for reuse, so activations and "
        "gradients fault in no pages; RSS follows the heap's high-water mark, fragmentation included. lean: blocks "
        "of 128 KiB or more go back to the OS when freed, so RSS follows the live tensors, at the price of page "
        "faults (docs/stages-and-precision.md).")
    prefetch_units: Literal["auto"] | int = _f(
        "auto", "Stage 3: units gathered ahead of the one computing, each costing a unit's gathered bytes. auto: 2 "
        "where a param group runs on whole parameters (Muon's matrices, an optimizer zerorun updates per parameter): "
        "their pieces hold whole matrices, so a unit's gather sends more one way than the other, and a second "
        "gather in flight keeps a link busy both ways; else 1 (docs/optimizers.md).", ge=0)
    hpz_partition_size: int = _f(
        1, "Stage 3, ZeRO++'s hpZ: after a unit is gathered from every rank, each rank keeps one piece of it out of "
        "this many (the ranks of its node), and the unit's next gathers (backward, later micro-steps) stay within "
        "those ranks until the step changes the parameters: they never cross the link. Exact; costs the model's "
        "size / hpz_partition_size per rank. Set it to the ranks per node; 1: off.", ge=1)
    param_persistence_threshold: int = _f(
        0, "Stage 3: parameters with fewer elements stay gathered (0: every parameter is sharded). A unit gathers "
           "all its parameters in one collective, so small ones cost no extra latency; DeepSpeed's 1e5 would keep "
           "every parameter of a small model whole.", ge=0)
    wrap: list[str] = _f(doc="Stage 3: module class names that become their own unit (e.g. Block); an unknown name "
                             "is an error. []: the model's layers (the children of its ModuleLists/Sequentials) and "
                             "any other child of at least a bucket. Outside them, a module of half a bucket or more "
                             "(an embedding, an output head) is split off the root unit and gathered around its use, "
                             "unless the first forward uses its parameters outside it.", factory=list)
    offload_optimizer: OffloadConfig = _f(doc="Offload of fp32 master weights and Adam moments.", factory=OffloadConfig)
    offload_param: OffloadConfig = _f(doc="Offload of parameters (stage 3 only).", factory=OffloadConfig)
    offload_optimizer_ratio: float = _f(
        1.0, "With offload_optimizer: cpu, the share of the optimizer state (fp32 master and moments) kept in host "
        "memory; the rest stays on the GPU and is updated there by the CUDA kernel while the host updates its "
        "share (DeepSpeed's Twin-Flow). Lower it where host memory is the wall: every 0.1 moves 1.2 bytes per "
        "parameter of the rank's shard from the host to the GPU. Split between units: the host keeps the first "
        "units in gradient order.", gt=0, le=1)
    aio: AioConfig = _f(doc="NVMe I/O settings for offload.", factory=AioConfig)


@dataclass
class PrecisionConfig:
    """Numeric formats: compute dtype and the fp16 dynamic loss scaler."""

    __shorthand__ = "dtype"  # `precision: bf16`

    dtype: Dtype = _f("fp32", "Parameter/activation/gradient dtype; master weights and moments are always fp32.")
    initial_loss_scale: float = _f(2.0**16, "fp16: loss scale at the start.", gt=0)
    growth_interval: int = _f(1000, "fp16: steps without overflow before the scale grows.", ge=1)
    growth_factor: float = _f(2.0, "fp16: multiplier when the scale grows.", gt=1)
    backoff_factor: float = _f(0.5, "fp16: multiplier after an overflow.", gt=0, lt=1)
    min_loss_scale: float = _f(1.0, "fp16: the scale never goes below this.", gt=0)
    dynamic_loss_scale: bool = _f(True, "fp16: false keeps initial_loss_scale fixed (an overflowing step is still "
                                        "skipped on every rank).")
    hysteresis: int = _f(1, "fp16: overflows in a row tolerated before the scale backs off (DeepSpeed's hysteresis; "
                            "the count refills when the scale grows).", ge=1)
    consecutive_hysteresis: bool = _f(False, "fp16: refill the hysteresis count after every step without overflow, "
                                             "not only when the scale grows.")


@dataclass
class OptimizerConfig:
    """The optimizer built when the script passes none to `zerorun.initialize` (docs/optimizers.md: how each runs)."""

    type: Literal["adamw", "adam", "sgd", "lion", "adagrad", "rmsprop", "adafactor", "lamb", "muon"] = _f(
        "adamw", "adamw: decoupled weight decay; adam: L2 added to the gradient; sgd, adagrad, rmsprop, adafactor: "
                 "torch's; lion, lamb: zerorun's (DeepSpeed's formulas); muon: torch's Muon for the hidden matrices "
                 "(2-D, names without `embed` or `lm_head`, as DeepSpeed chooses) and AdamW for the rest.")
    lr: float = _f(1e-3, "Learning rate (muon: Muon's; see adam_lr).", gt=0)
    betas: list[float] = _f(doc="(beta1, beta2), each in [0, 1): Adam's, AdamW's, LAMB's, Lion's and muon's AdamW's.",
                            factory=lambda: [0.9, 0.999])
    eps: float = _f(1e-8, "Added to the denominator (adam, adamw, adagrad, rmsprop, lamb; muon's AdamW).", gt=0)
    weight_decay: float = _f(0.01, "Weight decay.", ge=0)
    momentum: float | None = _f(None, "sgd, rmsprop: momentum (null: 0); muon: Muon's momentum (null: 0.95).",
                                ge=0, lt=1)
    nesterov: bool | None = _f(None, "sgd: Nesterov momentum (null: false); muon: Nesterov in Muon (null: true).")
    adam_lr: float | None = _f(None, "muon: the lr of the AdamW for the parameters Muon does not take (null: lr).",
                               gt=0)


# which keys of the optimizer section each type reads; setting another is refused (config/convert.py)
OPTIMIZER_KEYS = {
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "sgd": ("lr", "weight_decay", "momentum", "nesterov"),
    "lion": ("lr", "betas", "weight_decay"),
    "adagrad": ("lr", "eps", "weight_decay"),
    "rmsprop": ("lr", "eps", "weight_decay", "momentum"),
    "adafactor": ("lr", "weight_decay"),
    "lamb": ("lr", "betas", "eps", "weight_decay"),
    "muon": ("lr", "betas", "eps", "weight_decay", "momentum", "nesterov", "adam_lr"),
}


@dataclass
class TrainConfig:
    """The training loop's shape; the engine and the example scripts read it."""

    micro_batch_size: int = _f(2, "Samples per rank per forward.", ge=1)
    grad_accum_steps: int = _f(1, "Micro-batches per optimizer step.", ge=1)
    clip_grad_norm: float | None = _f(None, "Clip gradients to this global L2 norm (null: no clipping).", gt=0)
    activation_checkpointing: bool = _f(False, "Recompute each block's activations in backward instead of keeping "
                                               "them. The script applies it (recipes/train_gpt.py does); zerorun tune "
                                               "varies it only for a script that declares ZERORUN_HONOURS.")
    steps: int = _f(100, "Optimizer steps to train.", ge=1)
    global_batch_size: int | None = _f(None, "Samples per optimizer step over all ranks (DeepSpeed's "
                                             "train_batch_size): when set, micro_batch_size x grad_accum_steps x "
                                             "the world size must equal it, or the run is refused.", ge=1)
    seed: int = _f(0, "Seed for model initialisation and synthetic data.", ge=0)


@dataclass
class SchedulerConfig:
    """A learning-rate schedule with DeepSpeed's formulas, stepped after every applied optimizer step.

    The engine builds and steps it (`zerorun.initialize`, and the DeepSpeed-compatible engine alike);
    a script that also builds its own scheduler on the optimizer is refused.
    """

    type: Literal["none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"] = _f(
        "none", "The schedule (none: the optimizer's lr throughout).")
    warmup_min_lr: float = _f(0.0, "WarmupLR, WarmupDecayLR: lr at the first step.", ge=0)
    warmup_max_lr: float | None = _f(None, "WarmupLR, WarmupDecayLR: lr at the end of the warmup (null: the "
                                           "optimizer's lr).", ge=0)
    warmup_num_steps: int = _f(1000, "Warmup* schedules: steps of warmup (at least 2 are used).", ge=1)
    warmup_type: Literal["log", "linear"] = _f("log", "Warmup* schedules: how the warmup rises.")
    total_num_steps: int | None = _f(None, "WarmupDecayLR, WarmupCosineLR: the step at which the decay ends "
                                           "(null: train.steps).", ge=1)
    warmup_min_ratio: float = _f(0.0, "WarmupCosineLR: start of the warmup, as a fraction of the optimizer's lr.", ge=0)
    cos_min_ratio: float = _f(0.0001, "WarmupCosineLR: end of the cosine, as a fraction of the optimizer's lr.", ge=0)
    cycle_min_lr: float = _f(0.0, "OneCycle: lr at the bottom of the cycle.", ge=0)
    cycle_max_lr: float = _f(0.001, "OneCycle: lr at the top of the cycle.", ge=0)
    decay_lr_rate: float = _f(0.0, "OneCycle: lr decay rate after the cycle.", ge=0)
    cycle_first_step_size: int = _f(2000, "OneCycle: steps of the rising half.", ge=1)
    cycle_second_step_size: int | None = _f(None, "OneCycle: steps of the falling half (null: the first's).", ge=1)
    cycle_first_stair_count: int = _f(0, "OneCycle: stairs in the rising half (0: a continuous rise).", ge=0)
    cycle_second_stair_count: int | None = _f(None, "OneCycle: stairs in the falling half (null: the first's).",
                                              ge=0)
    decay_step_size: int = _f(0, "OneCycle: steps per decay interval after the cycle (0: no decay).", ge=0)
    cycle_momentum: bool = _f(True, "OneCycle: cycle beta1 inversely to the lr.")
    cycle_min_mom: float = _f(0.8, "OneCycle: beta1 at the top of the lr cycle.", ge=0, lt=1)
    cycle_max_mom: float = _f(0.9, "OneCycle: beta1 at the bottom of the lr cycle.", ge=0, lt=1)
    decay_mom_rate: float = _f(0.0, "OneCycle: beta1 decay rate after the cycle.", ge=0)
    lr_range_test_min_lr: float = _f(0.001, "LRRangeTest: the starting lr.", ge=0)
    lr_range_test_step_size: int = _f(2000, "LRRangeTest: steps per increase interval.", ge=1)
    lr_range_test_step_rate: float = _f(1.0, "LRRangeTest: increase per interval.", ge=0)
    lr_range_test_staircase: bool = _f(False, "LRRangeTest: increase in steps rather than continuously.")


@dataclass
class CheckpointConfig:
    """Sharded checkpoints."""

    dir: str | None = _f(None, "Checkpoint directory (null: no checkpoints).")
    every_steps: int = _f(0, "Save every N optimizer steps into checkpoint.dir (0: only when the script asks).",
                          ge=0)
    resume: str = _f("auto", "auto: resume from the latest checkpoint if any; never; or a tag to resume from.")
    allow_changes: bool = _f(False, "Resume a checkpoint saved with another optimizer type (adam/adamw) or precision "
                                    "(refused otherwise). Changed lr, weight decay, betas or eps are always allowed; "
                                    "the checkpoint's values win and rank 0 says which.")
    async_save: bool = _f(True, "Save in the background: a save copies this rank's state into host memory (or, on "
                                "NVMe, streams it before the next optimizer step changes it) and training goes on "
                                "while the files are written; `latest` moves only when every rank's files are "
                                "durable. false: the save writes everything before training continues.")
    every_minutes: float = _f(0.0, "Also save when this many minutes have passed since the last save (0: never by "
                                   "time). Costs one scalar all-reduce per optimizer step, so ranks agree.", ge=0)
    keep_last: int = _f(0, "After each save, delete all but the newest N checkpoints in checkpoint.dir (0: keep "
                           "all).", ge=0)


@dataclass
class TelemetryConfig:
    """Live telemetry streamed from the workers to the launcher's console."""

    enabled: bool = _f(True, "Stream per-rank memory and throughput to the launcher.")
    interval_s: float = _f(1.0, "Seconds between samples.", gt=0)
    stall_s: float = _f(300.0, "Report a stall (and every rank's stack) when no step finishes for this long.", gt=0)
    peak_tflops: float | None = _f(None, "Peak dense TFLOP/s of one device, for MFU (null: looked up from the "
                                         "GPU's name; MFU is n/a on CPU).", gt=0)
    tensorboard: bool = _f(False, "Also write TensorBoard event files to runs/<name>/tensorboard/<job id>/, from the "
                                  "telemetry stream, in the launcher (needs `pip install 'zerorun[tensorboard]'`).")
    csv: bool = _f(False, "Also write runs/<name>/csv/<job id>/steps.csv and samples.csv, from the telemetry "
                          "stream, in the launcher.")
    wandb: bool = _f(False, "Also log to a Weights & Biases run (the recipe as its config), from the telemetry stream, "
                            "in the launcher; W&B's own WANDB_MODE, WANDB_PROJECT, WANDB_DIR apply (needs "
                            "`pip install 'zerorun[wandb]'`; a failure is a warning).")
    mlflow: bool = _f(False, "Also log to an MLflow run (the recipe as its parameters), from the telemetry stream, in "
                             "the launcher; MLFLOW_TRACKING_URI says where (needs `pip install 'zerorun[mlflow]'`; "
                             "a failure is a warning).")
    profile_start: int | None = _f(
        None, "Record a torch.profiler trace on every rank from this optimizer step (counted from 0, as the logs "
              "count them), with zerorun's phases as named ranges; each rank writes "
              "runs/<name>/profile/<job id>/rank-<r>.trace.json.gz (Perfetto, chrome://tracing), and on a GPU a CUDA "
              "memory snapshot beside it. A failure to write is a warning (null: no profile).", ge=0)
    profile_steps: int = _f(2, "Optimizer steps the profile records, from profile_start.", ge=1)


@dataclass
class LaunchConfig:
    """Process lifecycle."""

    timeout_s: float = _f(300.0, "Collective timeout: a rank stuck this long in a collective fails the job.", gt=0)
    kill_grace_s: float = _f(3.0, "Seconds between SIGTERM and SIGKILL when tearing the job down.", ge=0)
    transport: Literal["auto", "local", "ssh", "slurm"] = _f(
        "auto", "How nodes are started; `zerorun launch --launcher` overrides it. auto: as slurm inside a Slurm "
                "allocation (SLURM_JOB_ID set) when no hostfile is given, else as local. local: localhost as a "
                "local process, other hostfile hosts over SSH. ssh: every host over SSH, this machine included. "
                "slurm: one srun step that starts a torchrun on every allocated node.")
    backend: Literal["auto", "nccl", "gloo"] = _f(
        "auto", "The process group's backend. auto: nccl on GPUs, gloo on CPUs. gloo on GPUs lets several ranks "
                "share one GPU (nproc_per_node above the GPU count; slow, for tests and debugging), which NCCL "
                "refuses. Exported to the workers as ZERORUN_BACKEND.")
    deepspeed_compat: bool = _f(False, "`import deepspeed` in the script gets zerorun's DeepSpeed-compatible API "
                                       "(zerorun.compat.deepspeed); on for a `zerorun launch script.py` command line.")
    deepspeed_local_rank: bool = _f(True, "With deepspeed_compat: append --local_rank=<local rank> to the script's "
                                          "arguments, as DeepSpeed's launcher does (its --no_local_rank: false).")
    max_restarts: int = _f(0, "After a failure, start the job again up to this many times, each from the latest "
                              "complete checkpoint (checkpoint.dir; from scratch with the same seed when there is "
                              "none). 0: a failure ends the job. `zerorun launch --max-restarts` overrides it.", ge=0)
    on_node_failure: Literal["retry", "shrink"] = _f(
        "retry", "When a node's link is lost (or it fails a restart's preflight). retry: restart on the same "
                 "nodes. shrink: restart without it, keeping the global batch by raising "
                 "train.grad_accum_steps (the job stops when the new world size does not divide it).")
    min_nodes: int = _f(1, "shrink: the fewest nodes a restart may run on.", ge=1)
    oversubscribe: bool = _f(False, "Allow more workers than CPU cores on a machine without GPUs (tests of several "
                                    "ranks on a small machine, debugging). Without it such a launch is refused "
                                    "before anything starts: the workers would take turns on the cores.")
    join_timeout_s: float = _f(
        600.0, "When every node runs its own launcher (`zerorun launch --nnodes N`, a Kubernetes Job): how long "
               "node 0 waits for the others to join, and the others for node 0 to answer, at the start and after "
               "a lost node (a replaced pod may take minutes to be scheduled and pull its image).", gt=0)


@dataclass
class SSHConfig:
    """How the launcher reaches other hosts; `~/.ssh/config` applies too, these settings win over it."""

    port: int | None = _f(None, "SSH port (null: ~/.ssh/config's, else 22).", ge=1, le=65535)
    user: str | None = _f(None, "Remote user (null: ~/.ssh/config's, else yours).")
    identity_file: str | None = _f(None, "Private key file (null: ssh's defaults and agent).")
    options: list[str] = _f(doc="Extra ssh options as KEY=VALUE, each passed as `-o KEY=VALUE` "
                                "(e.g. StrictHostKeyChecking=accept-new).", factory=list)


@dataclass
class Recipe:
    """A training job: what to run, on how many workers, and how to shard it."""

    script: str = _f(doc="The training script, relative to the recipe file (required).")
    args: list[str] = _f(doc="Arguments passed to the script (a list, or one string split like a shell).", factory=list)
    name: str | None = _f(None, "Run name: telemetry goes to runs/<name>/ (default: the recipe file's stem).")
    nproc_per_node: int | None = _f(None, "Workers per node (default: the node's GPUs, or 2 CPU workers). With a hostfile it caps each host's slots, like --num-gpus, unless --num-gpus/--include/--exclude is given.", ge=1)
    hostfile: str | None = _f(None, "DeepSpeed-style hostfile for multi-node jobs (relative to the recipe file).")
    master_addr: str | None = _f(None, "Rendezvous address (default: the first node).")
    master_port: int | None = _f(None, "Rendezvous port (default: a free port).", ge=1, le=65535)
    env: dict[str, str] = _f(doc="Extra environment variables for every worker.", factory=dict)
    deepspeed_config: str | None = _f(None, "A DeepSpeed JSON config read into this recipe (relative to the recipe "
                                            "file); the recipe's own keys win over it. See docs/deepspeed.md.")
    launch: LaunchConfig = _f(doc="Process lifecycle.", factory=LaunchConfig)
    ssh: SSHConfig = _f(doc="SSH to the other hosts of a multi-node job.", factory=SSHConfig)
    zero: ZeroConfig = _f(doc="ZeRO partitioning.", factory=ZeroConfig)
    precision: PrecisionConfig = _f(doc="Numeric formats.", factory=PrecisionConfig)
    optimizer: OptimizerConfig = _f(doc="Default optimizer.", factory=OptimizerConfig)
    scheduler: SchedulerConfig = _f(doc="Learning-rate schedule.", factory=SchedulerConfig)
    train: TrainConfig = _f(doc="Training loop.", factory=TrainConfig)
    checkpoint: CheckpointConfig = _f(doc="Checkpoints.", factory=CheckpointConfig)
    telemetry: TelemetryConfig = _f(doc="Telemetry.", factory=TelemetryConfig)
    source: str | None = field(default=None, metadata={"internal": True})  # the recipe file, for messages
    # dotted key -> where the user gave it ("recipe.yaml:12", "--set ..."): keys left at their default are absent
    given: dict[str, str] = field(default_factory=dict, metadata={"internal": True})



def dataclass_at(dotted: str) -> type | None:
    """The section class a dotted key names (`zero.offload_param` -> OffloadConfig), or None for a leaf."""
    cls: Any = Recipe
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return None
        cls = hints[part]
    return typing.cast(type, cls)


def shorthand_of(section: str) -> str | None:
    """The key a scalar stands for in a section written as one value (`offload_optimizer: cpu` -> device)."""
    return getattr(dataclass_at(section), "__shorthand__", None)


def range_text(meta: typing.Mapping[str, Any]) -> str:
    """A field's bounds in words (`>= 0 and < 1`), for messages and the reference."""
    parts = [f"{sign} {meta[name]:g}" for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
             if name in meta]
    return " and ".join(parts)


def literal_text(value: Any) -> str:
    """A Literal's value as a recipe writes it (YAML's true/false, not Python's)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
