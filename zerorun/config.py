"""The recipe: typed dataclasses that are the one definition of every key, type, default and range.

A recipe is a YAML file (see `recipes/quickstart.yaml`). `load(path, overrides)` reads it, applies
`--set key.path=value` overrides, and validates everything against the dataclasses below. Every
problem becomes one `ConfigError` naming the file, the line and the dotted key (or the `--set`
that caused it) and what was expected, never a traceback.

Each field's `doc` metadata is its documentation: docs/recipes.md's recipe reference is generated from
it (`reference_markdown()`), and a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from zerorun.errors import ConfigError

RECIPE_ENV = "ZERORUN_RECIPE"  # the launcher passes the resolved recipe to workers as JSON
GIVEN_KEY = "_given"  # in `to_json`: the keys the user set (`Recipe.given`), so a worker can name them
RECIPE_FILE_ENV = "ZERORUN_RECIPE_FILE"  # ... which the node supervisor puts in a file of the job's (see launch.node)
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few hundred keys: a larger file is a mistake, and every rank reads it
MAX_YAML_NODES = 100_000  # YAML values after alias expansion (`*name` repeats what `&name` holds)
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell (and `env K=V`) accepts as a variable name
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
    bucket_mb: float = _f(25.0, "Stages 0-2: size of a gradient reduce(-scatter) bucket, MiB; each bucket is also "
                                "all-gathered as a whole after the step.", gt=0)
    allgather_bucket_mb: float = _f(25.0, "Stage 3: the largest flat buffer a unit's parameters are all-gathered in "
                                          "(its gradients are reduce-scattered in the same pieces), MiB.", gt=0)
    cpu_collectives: Literal["auto", "shm", "gloo"] = _f(
        "auto", "CPU ranks: auto and shm carry collectives through a shared-memory segment when every rank is on "
        "one host (memory speed; auto falls back to gloo where it cannot, shm refuses); gloo: always the process "
        "group's TCP loopback.")
    quantized_gradients: bool = _f(
        False, "Stages 1-3, ZeRO++'s qgZ: gradients crossing the network (gloo, where shared memory cannot carry "
        "them: ranks on other nodes) are sent as int8 in blocks of 2048 with an fp32 scale each, a quarter of the "
        "bytes, and summed in fp32. Changes the numbers slightly (docs/cluster.md measures the loss).")
    quantized_weights: bool = _f(
        False, "Stages 1-3, ZeRO++'s qwZ: parameters cross the network (gloo) as int8 in blocks of 2048 with an fp32 "
        "scale each when all-gathered (stage 3: to compute with; stages 1/2: after the step), a quarter of the "
        "bytes; every rank computes with the same dequantized weights, the fp32 masters stay exact (stages 1/2 "
        "in fp32 then keep a master shard apart from the parameters: 4 bytes per parameter / world size).")
    host_memory: Literal["fast", "lean"] = _f(
        "fast", "How glibc treats host memory freed in training (stage 3 on CPU re-gathers a unit into the memory "
        "it released either way). fast: freed blocks of up to 32 MiB are kept for reuse, so activations and "
        "gradients fault in no pages; RSS follows the heap's high-water mark, fragmentation included. lean: blocks "
        "of 128 KiB or more go back to the OS when freed, so RSS follows the live tensors, at the price of page "
        "faults (docs/stages-and-precision.md).")
    prefetch_units: int = _f(1, "Stage 3: units gathered ahead of the one computing.", ge=0)
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
    """The optimizer built when the script passes none to `zerorun.initialize`."""

    type: Literal["adamw", "adam"] = _f("adamw", "adamw: decoupled weight decay; adam: L2 added to the gradient.")
    lr: float = _f(1e-3, "Learning rate.", gt=0)
    betas: list[float] = _f(doc="Adam's (beta1, beta2), each in [0, 1).", factory=lambda: [0.9, 0.999])
    eps: float = _f(1e-8, "Added to the denominator.", gt=0)
    weight_decay: float = _f(0.01, "Weight decay.", ge=0)


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


# ---------------------------------------------------------------------------------------------
# Loading


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = (), check_script: bool = True) -> Recipe:
    """Read, override and validate a recipe file; `script` and `hostfile` become absolute paths."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the recipe ({exc.strerror or exc}).") from None
    _check_size(len(raw), str(path))
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file ({exc.reason} at byte {exc.start}).") from None
    data, lines = _parse_yaml(text, str(path))
    _apply_overrides(data, lines, overrides)
    _read_deepspeed_config(data, lines, path.resolve().parent, str(path))
    recipe = from_dict(data, str(path), lines)
    recipe.source = str(path.resolve())
    if recipe.name is None:
        recipe.name = path.stem
    base = path.resolve().parent
    recipe.script = str(base / recipe.script)
    if check_script and not Path(recipe.script).is_file():
        raise ConfigError(f"{_where(str(path), lines, 'script')}: script: {recipe.script} does not exist "
                          "(paths are relative to the recipe file).")
    if recipe.hostfile is not None:
        recipe.hostfile = str(base / recipe.hostfile)
    return recipe


def loads(text: str, source: str = "<recipe>", overrides: typing.Sequence[str] = ()) -> Recipe:
    """Validate a recipe given as YAML text (paths stay as written)."""
    _check_size(len(text.encode()), source)
    data, lines = _parse_yaml(text, source)
    _apply_overrides(data, lines, overrides)
    _read_deepspeed_config(data, lines, Path.cwd(), source)
    recipe = from_dict(data, source, lines)
    recipe.source = source
    return recipe


def from_dict(data: Any, source: str = "<recipe>", lines: dict[str, int | str] | None = None) -> Recipe:
    """Build and validate a Recipe from plain data (parsed YAML or `to_dict` output)."""
    ctx = _Ctx(source, lines or {})
    if data is None:
        data = {}
    if isinstance(data, dict) and "script" not in data:
        raise ConfigError(f"{source}: script: missing; every recipe names its training script, e.g. `script: train.py`.")
    given = data.pop(GIVEN_KEY, None) if isinstance(data, dict) else None
    recipe = _build(Recipe, data, "", ctx)
    _check_cross_fields(recipe, ctx)
    recipe.given = dict(given) if isinstance(given, dict) else {k: _where(source, ctx.lines, k) for k in ctx.lines}
    return recipe


def to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data, round-trippable through `from_dict` (used to hand the recipe to workers)."""
    data = dataclasses.asdict(recipe)
    data.pop("source")
    data.pop("given")
    return data


def to_json(recipe: Recipe) -> str:
    """The recipe for a worker: `to_dict` plus which keys the user gave, and where (`Recipe.given`)."""
    return json.dumps({**to_dict(recipe), GIVEN_KEY: recipe.given}, sort_keys=True)


def given_in(recipe: Recipe, section: str) -> dict[str, str]:
    """The keys of `section` (e.g. "optimizer") the user set, each with where: file:line or the `--set`."""
    return {k: where for k, where in recipe.given.items() if k == section or k.startswith(section + ".")}


def from_env() -> Recipe | None:
    """The recipe the launcher injected into this worker, or None outside a zerorun launch."""
    blob = os.environ.get(RECIPE_ENV)
    if os.environ.get(RECIPE_FILE_ENV):  # what a node supervisor hands its workers (see launch.node)
        with open(os.environ[RECIPE_FILE_ENV]) as file:
            blob = file.read()
    if not blob:
        return None
    recipe = from_dict(json.loads(blob), f"${RECIPE_ENV}")
    recipe.source = os.environ.get(RECIPE_ENV + "_SOURCE")
    return recipe


def check_global_batch(recipe: Recipe, world_size: int) -> None:
    """`train.global_batch_size` against the world size the job runs on: a ConfigError when they disagree."""
    train = recipe.train
    if train.global_batch_size is None:
        return
    actual = train.micro_batch_size * train.grad_accum_steps * world_size
    if actual != train.global_batch_size:
        origin = f" (from {recipe.deepspeed_config}: train_batch_size)" if recipe.deepspeed_config else ""
        raise ConfigError(f"{recipe.source or 'the recipe'}: train.global_batch_size: {train.global_batch_size}"
                          f"{origin} != micro_batch_size {train.micro_batch_size} x grad_accum_steps "
                          f"{train.grad_accum_steps} x world size {world_size} = {actual}; change one of them "
                          "(or the number of workers).")


def _read_deepspeed_config(data: Any, lines: dict[str, int | str], base: Path, source: str) -> None:
    """`deepspeed_config: ds.json`: the DeepSpeed config, translated, under the recipe's own keys
    (which win, `--set` included); messages about its keys name the JSON file and the DeepSpeed key."""
    if not isinstance(data, dict) or data.get("deepspeed_config") in (None, ""):
        return
    # A leaf module (JSON -> plain recipe data) that imports nothing of config: no import cycle.
    from zerorun import ds_config

    ds_path = base / str(data["deepspeed_config"])
    if not ds_path.is_file():
        raise ConfigError(f"{_where(source, lines, 'deepspeed_config')}: deepspeed_config: {ds_path} does not "
                          "exist (paths are relative to the recipe file).")
    translation = ds_config.read(ds_path)
    ds_config.report(translation, str(ds_path))
    _merge_under(data, translation.data, "")
    for key, origin in translation.origins.items():
        lines.setdefault(key, f"{ds_path}: {origin}")
    data["deepspeed_config"] = str(ds_path)


def _merge_under(data: dict[str, Any], base: dict[str, Any], prefix: str) -> None:
    """Fill `data` with `base`'s keys where `data` has none (a shorthand scalar is expanded first)."""
    for key, value in base.items():
        if key not in data or data[key] is None:
            data[key] = value
        elif isinstance(value, dict):
            if not isinstance(data[key], dict):
                data[key] = _expand_shorthand(prefix + key, data[key]) or data[key]
            if isinstance(data[key], dict):
                _merge_under(data[key], value, f"{prefix}{key}.")


# ---------------------------------------------------------------------------------------------
# YAML with line numbers


def _check_size(size: int, source: str) -> None:
    if size > MAX_RECIPE_BYTES:
        raise ConfigError(f"{source}: the recipe is over {MAX_RECIPE_BYTES >> 20} MiB; a recipe holds settings, "
                          "not data: keep large inputs in files the script reads, and name them in `args`.")


def _parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[str, int | str]]:
    """Parse YAML into plain data plus a dotted-key -> line table (for messages).

    Safe YAML only (a `!!python/...` tag is refused with its line), at most `MAX_YAML_NODES` values
    once aliases are expanded (a 1 KB "billion laughs" would otherwise take gigabytes), no alias
    inside itself."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{_yaml_where(exc, source)}: not valid YAML: {_yaml_problem(exc)}.") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply.") from None
    if root is None:
        return {}, {}
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{source}:{root.start_mark.line + 1}: a recipe is a mapping of keys (like `script: train.py`).")
    _check_expansion(root, source)
    lines: dict[str, int] = {}
    _record_lines(root, "", lines, source)
    try:
        data = yaml.SafeLoader(text).get_single_data()
    except yaml.YAMLError as exc:  # a tag safe YAML has no constructor for: `!!python/object:...`
        raise ConfigError(f"{_yaml_where(exc, source)}: not allowed in a recipe: {_yaml_problem(exc)} (a recipe "
                          "is plain YAML: mappings, lists, strings, numbers, booleans).") from None
    return data, lines


def _yaml_where(exc: yaml.YAMLError, source: str) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f"{source}:{mark.line + 1}" if mark else source


def _yaml_problem(exc: yaml.YAMLError) -> str:
    return str(getattr(exc, "problem", None) or exc).split(" in \"")[0]


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse a document whose aliases expand past `MAX_YAML_NODES` values, or contain themselves."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in open_nodes:
            raise ConfigError(f"{source}:{node.start_mark.line + 1}: an alias refers to the value that holds it "
                              "(a recursive &anchor); write the value out.")
        if id(node) not in sizes:
            open_nodes.add(id(node))
            children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
                node.value if isinstance(node, yaml.SequenceNode) else []
            sizes[id(node)] = min(MAX_YAML_NODES + 1, 1 + sum(size(child) for child in children))
            open_nodes.discard(id(node))
        return sizes[id(node)]

    try:
        if size(root) <= MAX_YAML_NODES:
            return
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply.") from None
    node = root  # name the innermost value that is too large by itself: the top of the alias chain
    while True:
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        big = [child for child in children if sizes.get(id(child), 0) > MAX_YAML_NODES]
        if not big:
            break
        node = big[0]
    raise ConfigError(f"{source}:{node.start_mark.line + 1}: this value expands to more than {MAX_YAML_NODES:,} "
                      "YAML values through its aliases (*name repeats what &name holds); a recipe needs no such "
                      "expansion: write the values out.")


def _record_lines(node: yaml.Node, prefix: str, lines: dict[str, int | str], source: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"{source}:{line}: {key}: given twice (first at line {lines[key]}).")
        seen.add(key)
        lines[key] = line
        _record_lines(value_node, key + ".", lines, source)


def _apply_overrides(data: dict[str, Any], lines: dict[str, int | str], overrides: typing.Sequence[str]) -> None:
    """Apply `key.path=value` strings; the value is read as YAML (`3`, `1e-4`, `true`, `[a, b]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set zero.stage=3.")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                # A shorthand scalar (`precision: bf16`) becomes its mapping before a subkey is set.
                child = _expand_shorthand(".".join(parts[: depth + 1]), child)
                node[part] = child
            node = child
        node[parts[-1]] = value
        for stale in [k for k in lines if k == key or k.startswith(key + ".")]:
            del lines[stale]
        lines[key] = f"--set {item}"


def _expand_shorthand(dotted: str, value: Any) -> dict[str, Any]:
    cls = _dataclass_at(dotted)
    short = getattr(cls, "__shorthand__", None) if cls else None
    if value is None or cls is None:
        return {}
    if short is not None and not isinstance(value, (dict, list)):
        return {short: value}
    return {}


def shorthand_of(section: str) -> str | None:
    """The key a scalar stands for in a section written as one value (`offload_optimizer: cpu` -> device)."""
    return getattr(_dataclass_at(section), "__shorthand__", None)


def _dataclass_at(dotted: str) -> type | None:
    cls: Any = Recipe
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return None
        cls = hints[part]
    return cls


# ---------------------------------------------------------------------------------------------
# Validation: plain data -> dataclasses


@dataclass
class _Ctx:
    source: str
    lines: dict[str, int | str]  # dotted key -> line in the file, or the `--set ...` that gave it


def _where(source: str, lines: dict[str, int | str], key: str) -> str:
    """`file:line` for a dotted key (or its nearest parent), or the `--set` that gave it."""
    probe = key.split("[")[0]
    while probe:
        line = lines.get(probe)
        if isinstance(line, str):
            return line
        if line:
            return f"{source}:{line}"
        probe = probe.rpartition(".")[0]
    return source


def _fail(ctx: _Ctx, key: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{_where(ctx.source, ctx.lines, key)}: {key}: {message}")


def _build(cls: type, data: Any, prefix: str, ctx: _Ctx) -> Any:
    short = getattr(cls, "__shorthand__", None)
    if short is not None and data is not None and not isinstance(data, (dict, list)):
        data = {short: data}
    if not isinstance(data, dict):
        _fail(ctx, prefix.rstrip(".") or "(top level)",
              f"expected a mapping of keys, got {_describe(data)}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in data:
        if key not in fields:
            _fail(ctx, f"{prefix}{key}", f"unknown key{_suggest(str(key), fields)}")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _convert(hints[name], data[name], f"{prefix}{name}", f.metadata, ctx)
    return cls(**values)


def _suggest(key: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f"; valid keys here: {', '.join(sorted(choices))}."


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{type(value).__name__} {value!r}"


def _convert(tp: Any, value: Any, key: str, meta: typing.Mapping[str, Any], ctx: _Ctx) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key, meta, ctx)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", ctx)
    if origin is Literal:
        if (type(value), value) not in {(type(a), a) for a in args}:  # 1 is not true, nor "1" 1
            close = difflib.get_close_matches(str(value), [_literal_text(a) for a in args], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            _fail(ctx, key, f"expected one of {', '.join(map(_literal_text, args))}, got {_describe(value)}{hint or '.'}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(ctx, key, f"expected true or false, got {_describe(value)}.")
        return value
    if tp in (int, float):
        return _check_bounds(_number(tp, value, key, ctx), key, meta, ctx)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            _fail(ctx, key, f"expected a string, got {_describe(value)}.")
        return str(value)
    if origin is list:
        return _convert_list(args[0], value, key, meta, ctx)
    if origin is dict:
        if not isinstance(value, dict):
            _fail(ctx, key, f"expected a mapping of NAME: value, got {_describe(value)}.")
        for k, v in value.items():
            if isinstance(v, (dict, list)) or v is None:
                _fail(ctx, f"{key}.{k}", f"expected a plain value, got {_describe(v)}.")
        return {str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items()}
    raise AssertionError(f"config: no converter for {tp!r} at {key}")


def _number(tp: type, value: Any, key: str, ctx: _Ctx) -> int | float:
    # PyYAML reads `1e5` and `3e-4` (no dot) as strings; users mean numbers.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            _fail(ctx, key, f"expected {'an integer' if tp is int else 'a number'}, got {_describe(value)}.")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(ctx, key, f"expected {'an integer' if tp is int else 'a number'}, got {_describe(value)}.")
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            _fail(ctx, key, f"expected an integer, got {value!r}.")
        return int(value)
    return float(value)


def _check_bounds(value: float, key: str, meta: typing.Mapping[str, Any], ctx: _Ctx) -> float:
    tests = [("ge", value >= meta.get("ge", value), ">="), ("gt", "gt" not in meta or value > meta["gt"], ">"),
             ("le", value <= meta.get("le", value), "<="), ("lt", "lt" not in meta or value < meta["lt"], "<")]
    for name, ok, sign in tests:
        if not ok:
            _fail(ctx, key, f"must be {_range_text(meta)}, got {value!r}.")
    return value


def _range_text(meta: typing.Mapping[str, Any]) -> str:
    parts = [f"{sign} {meta[name]:g}" for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
             if name in meta]
    return " and ".join(parts)


def _convert_list(item_tp: Any, value: Any, key: str, meta: typing.Mapping[str, Any], ctx: _Ctx) -> list[Any]:
    if item_tp is str and isinstance(value, str):
        return shlex.split(value)
    if not isinstance(value, list):
        _fail(ctx, key, f"expected a list, got {_describe(value)}.")
    out = []
    for i, item in enumerate(value):
        if item_tp is str:
            if isinstance(item, (dict, list)) or item is None:
                _fail(ctx, f"{key}[{i}]", f"expected a string, got {_describe(item)}.")
            out.append(str(item))
        else:
            out.append(_convert(item_tp, item, f"{key}[{i}]", meta, ctx))
    return out


def _check_cross_fields(recipe: Recipe, ctx: _Ctx) -> None:
    """Rules that involve more than one key."""
    if not recipe.script:
        _fail(ctx, "script", "must name the training script.")
    betas = recipe.optimizer.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        _fail(ctx, "optimizer.betas", f"expected two numbers in [0, 1), got {betas!r}.")
    for kind in ("offload_optimizer", "offload_param"):
        off: OffloadConfig = getattr(recipe.zero, kind)
        if off.device == "nvme" and not off.nvme_path:
            _fail(ctx, f"zero.{kind}.nvme_path", "required when device is nvme (a directory on a fast local disk).")
    if recipe.zero.offload_param.device != "none" and recipe.zero.stage != 3:
        _fail(ctx, "zero.offload_param.device",
              f"parameter offload needs zero.stage: 3 (stage is {recipe.zero.stage}); "
              "use zero.offload_optimizer for stages 1 and 2.")
    if recipe.zero.offload_param.device != "none" and recipe.zero.offload_optimizer.device == "none":
        _fail(ctx, "zero.offload_param.device",
              "parameter offload needs zero.offload_optimizer too: the fp32 master is the larger copy of the "
              "parameters, so offload it first (e.g. offload_optimizer: cpu).")
    if recipe.zero.quantized_gradients and recipe.zero.stage == 0:
        _fail(ctx, "zero.quantized_gradients", "stage 0 all-reduces gradients; quantized gradients apply to the "
              "reduce-scatter of zero.stage 1, 2 or 3. Raise the stage or leave this off.")
    if recipe.zero.hpz_partition_size > 1 and recipe.zero.stage != 3:
        _fail(ctx, "zero.hpz_partition_size", f"the secondary copy is of stage 3's gathered parameters (stage is "
              f"{recipe.zero.stage}). Use zero.stage: 3 or leave it at 1.")
    if recipe.zero.quantized_weights and recipe.zero.stage == 0:
        _fail(ctx, "zero.quantized_weights", "stage 0 gathers no weights (every rank updates all of them); "
              "quantized weights apply to the all-gathers of zero.stage 1, 2 or 3. Raise the stage or leave this off.")
    if recipe.zero.offload_optimizer.device != "none" and recipe.zero.stage == 0:
        _fail(ctx, "zero.offload_optimizer.device", "optimizer offload needs zero.stage >= 1.")
    for key in ("every_steps", "every_minutes"):
        value = getattr(recipe.checkpoint, key)
        if value and not recipe.checkpoint.dir:
            _fail(ctx, f"checkpoint.{key}", f"{value} saves nothing without checkpoint.dir; "
                  f"set checkpoint.dir (a directory every node can write) or {key}: 0.")
    for key, value in recipe.env.items():
        if not ENV_KEY.fullmatch(key):
            _fail(ctx, f"env.{key}", "is not an environment variable name (letters, digits and '_', not starting "
                  "with a digit); write `env: {NAME: value}`.")
        if "\0" in value:
            _fail(ctx, f"env.{key}", "a value cannot hold a NUL character.")
    if recipe.zero.aio.block_size % 4096:
        _fail(ctx, "zero.aio.block_size", f"must be a multiple of 4096 (O_DIRECT), got {recipe.zero.aio.block_size}.")


# ---------------------------------------------------------------------------------------------
# Reference documentation


def _literal_text(value: Any) -> str:
    """A Literal's value as a recipe writes it (YAML's true/false, not Python's)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{_type_text(inner[0])} or null"
    if origin is Literal:
        return " \\| ".join(map(_literal_text, args))
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return ""
    return f"`{json.dumps(value)}`"


def reference_rows(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every recipe key, depth first."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp = hints[f.name]
        doc = f.metadata.get("doc", "")
        if f.metadata.keys() & {"ge", "gt", "le", "lt"}:
            doc += f" Must be {_range_text(f.metadata)}."
        if dataclasses.is_dataclass(tp):
            short = getattr(tp, "__shorthand__", None)
            if short:
                doc += f" May be given as just the `{short}` value."
            rows.append((f"{prefix}{f.name}", "section", "", doc))
            rows.extend(reference_rows(tp, f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", _type_text(tp), _default_text(f), doc))
    return rows


def reference_markdown() -> str:
    """The recipe reference table of docs/recipes.md."""
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{k}` | {t} | {d} | {doc} |" for k, t, d, doc in reference_rows()]
    return "\n".join(out) + "\n"
