"""Every DeepSpeed config key zerorun knows, and what becomes of it: the table behind `ds_config`.

Each key (dotted, as in the JSON: `zero_optimization.offload_optimizer.device`) has one `Rule`:

- `target`: the recipe key it becomes, with `convert` turning DeepSpeed's value into ours;
- `handled`: read by one of `ds_config`'s section handlers, because it means something only
  together with other keys (the batch triple, `fp16.enabled`, the optimizer's type);
- otherwise the key has no recipe key, and `level` says how much that matters: `INFO` when
  zerorun does the same thing anyway (`contiguous_gradients`), `WARNING` when the key tunes
  something zerorun does its own way but training computes the same (`sub_group_size`), `ERROR`
  when ignoring it would change what is trained (`optimizer.params.amsgrad: true`).
  Values in `harmless` (DeepSpeed's defaults, or "off") are always fine.

A rule for a section (`tensorboard`) covers every key below it. docs/deepspeed.md's DeepSpeed key table is
generated from this one (`reference_markdown`), and a test keeps the two in step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Level(enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


# DeepSpeed's optimizer types (lower-cased, as DeepSpeed compares them) -> the recipe's optimizer.type; the
# 1-bit ones compress their own communication, which zerorun does with zero.quantized_gradients instead
DS_OPTIMIZERS = {"adam": "adamw", "adamw": "adamw", "lamb": "lamb", "fusedlamb": "lamb", "lion": "lion",
                 "adagrad": "adagrad", "muon": "muon", "sgd": "sgd", "rmsprop": "rmsprop", "adafactor": "adafactor"}
COMPRESSED_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")


@dataclass(frozen=True)
class Rule:
    """What one DeepSpeed key becomes."""

    why: str  # what zerorun does with the key, or instead of it
    target: str | None = None  # the recipe key it maps to
    convert: Callable[[Any], Any] | None = None  # DeepSpeed's value -> the recipe's (ValueError: refused)
    level: Level = Level.INFO  # how much an unmapped, not harmless value matters
    harmless: tuple[Any, ...] = ()  # values that change nothing
    handled: bool = False  # a section handler in ds_config reads it
    section: bool = False  # covers every key below it


MIB = 2**20


def _elements_to_mib(value: Any) -> float:
    """DeepSpeed sizes buckets in elements; zerorun in MiB of fp32 (gradients are reduced in fp32)."""
    return max(int(value), 1) * 4 / MIB


def _clip(value: Any) -> float | None:
    return None if float(value) == 0 else float(value)


def _positive(value: Any) -> float:
    if float(value) <= 0:
        raise ValueError(f"must be > 0, got {value!r}")
    return float(value)


def _stage(value: Any) -> int:
    if isinstance(value, bool) or int(value) not in (0, 1, 2, 3):
        raise ValueError(f"expected a ZeRO stage 0-3, got {value!r}")
    return int(value)


def _device(value: Any) -> str:
    if value not in ("none", "cpu", "nvme", None):
        raise ValueError(f"expected none, cpu or nvme, got {value!r}")
    return value or "none"


def _reduce_dtype(value: Any) -> str:
    if value not in ("fp32", "bf16"):
        raise ValueError(f"expected fp32 or bf16, got {value!r}")
    return str(value)


_TELEMETRY = ("zerorun's telemetry streams loss, step time, throughput and memory per rank to the launcher's "
              "console and runs/<name>/telemetry.jsonl")

RULES: dict[str, Rule] = {
    # --- batch: DeepSpeed's rule train_batch_size = micro x accumulation x world size
    "train_batch_size": Rule("train.global_batch_size; with the world size it gives the micro-batch or the "
                             "accumulation DeepSpeed's way", handled=True),
    "train_micro_batch_size_per_gpu": Rule("train.micro_batch_size", handled=True),
    "gradient_accumulation_steps": Rule("train.grad_accum_steps", handled=True),
    "gradient_clipping": Rule("train.clip_grad_norm (0: no clipping)", target="train.clip_grad_norm", convert=_clip),
    "steps_per_print": Rule("zerorun's launcher shows every step live instead (telemetry)"),
    "wall_clock_breakdown": Rule("step, forward/backward and comm times are always in zerorun's telemetry"),
    "memory_breakdown": Rule("memory per kind and place is always in zerorun's telemetry (engine.memory())"),
    "dump_state": Rule("zerorun prints the resolved recipe with `zerorun launch --dry-run`"),
    "prescale_gradients": Rule("zerorun divides the reduced gradient sum once, in fp32, inside the Adam pass",
                               harmless=(False,), level=Level.WARNING),
    "gradient_predivide_factor": Rule("zerorun divides the reduced gradient sum once, in fp32, inside the Adam pass",
                                      harmless=(1, 1.0), level=Level.WARNING),
    "communication_data_type": Rule("zerorun sums gradients across ranks in the dtype it accumulates them in, "
                                    "zero.reduce_dtype (data_types.grad_accum_dtype)",
                                    harmless=("fp32", None), level=Level.WARNING),
    "data_types.grad_accum_dtype": Rule("zero.reduce_dtype, fp32 or bf16 (unset: fp32, where DeepSpeed's default "
                                        "is the compute dtype)", target="zero.reduce_dtype", convert=_reduce_dtype),
    "data_types.param_dtype": Rule("zerorun keeps parameters in precision.dtype (fp32 masters)", harmless=(None,),
                                   level=Level.WARNING),
    "data_types.buffer_dtype": Rule("zerorun keeps buffers as the model has them", harmless=(None,),
                                    level=Level.WARNING),
    "sparse_gradients": Rule("zerorun reduces dense gradients only", harmless=(False,), level=Level.ERROR),
    "disable_allgather": Rule("zerorun publishes updated shards with its own all-gather", harmless=(False,),
                              level=Level.WARNING),
    "zero_allow_untested_optimizer": Rule("zerorun runs any torch optimizer, the way its update needs "
                                          "(docs/optimizers.md): there is nothing to allow"),
    "zero_force_ds_cpu_optimizer": Rule("optimizer offload steps zerorun's CPU Adam kernel for Adam, the script's "
                                        "optimizer on the host for any other"),
    "dataloader_drop_last": Rule("the DataLoader deepspeed.initialize builds from training_data drops the last "
                                 "partial batch when true", handled=True),
    "seed": Rule("zerorun seeds nothing itself: the script's torch.manual_seed decides", level=Level.WARNING),
    # --- precision
    "fp16.enabled": Rule("precision.dtype: fp16", handled=True),
    "fp16.auto_cast": Rule("zerorun's engine always casts floating-point inputs to the compute dtype"),
    "fp16.loss_scale": Rule("0: dynamic scaling; > 0: precision.initial_loss_scale with "
                            "precision.dynamic_loss_scale false", handled=True),
    "fp16.initial_scale_power": Rule("precision.initial_loss_scale = 2 ** power", handled=True),
    "fp16.loss_scale_window": Rule("precision.growth_interval (DeepSpeed's first growth comes one clean step later)",
                                   target="precision.growth_interval", convert=int),
    "fp16.hysteresis": Rule("precision.hysteresis", target="precision.hysteresis", convert=int),
    "fp16.consecutive_hysteresis": Rule("precision.consecutive_hysteresis", target="precision.consecutive_hysteresis",
                                        convert=bool),
    "fp16.min_loss_scale": Rule("precision.min_loss_scale", target="precision.min_loss_scale", convert=_positive),
    "fp16.fp16_master_weights_and_grads": Rule("zerorun's master weights and gradients are always fp32",
                                               harmless=(False,), level=Level.ERROR),
    "bf16.enabled": Rule("precision.dtype: bf16", handled=True),
    "bfloat16": Rule("DeepSpeed's old name for bf16", handled=True, section=True),
    "bf16.immediate_grad_update": Rule("zerorun accumulates bf16 gradients into fp32 buckets as they arrive"),
    "bf16.check_grad_overflow": Rule("zerorun skips a step with inf/nan gradients on every rank, in every dtype",
                                     harmless=(True,), level=Level.WARNING),
    "bf16.bf16_master_weights_and_grads": Rule("zerorun's master weights and gradients are always fp32",
                                               harmless=(False,), level=Level.ERROR),
    "bf16.bf16_optimizer_states": Rule("zerorun keeps an optimizer's state as it makes it from fp32 masters",
                                       harmless=(False,), level=Level.ERROR),
    "torch_autocast": Rule("zerorun casts parameters to the compute dtype instead of autocasting; use bf16.enabled",
                           section=True, level=Level.ERROR),
    "amp": Rule("apex AMP is not supported; use fp16.enabled or bf16.enabled", section=True, level=Level.ERROR),
    # --- optimizer
    "optimizer.type": Rule("Adam (AdamW unless adam_w_mode is false), AdamW, Lamb, Lion, Adagrad, Muon, SGD, RMSprop, "
                           "Adafactor -> optimizer.type", handled=True),
    "optimizer.params.momentum": Rule("optimizer.momentum (SGD, RMSprop, Muon)", target="optimizer.momentum",
                                      convert=float),
    "optimizer.params.nesterov": Rule("optimizer.nesterov (SGD, Muon)", target="optimizer.nesterov", convert=bool),
    "optimizer.params.muon_lr": Rule("Muon's lr -> optimizer.lr", handled=True),
    "optimizer.params.adam_lr": Rule("the lr of Muon's AdamW -> optimizer.adam_lr", target="optimizer.adam_lr",
                                     convert=float),
    "optimizer.params.max_coeff": Rule("zerorun's Lamb clamps its trust ratio to at most 10, DeepSpeed's default; "
                                       "pass zerorun.Lamb(params, max_coeff=...) to deepspeed.initialize(optimizer=) "
                                       "for another", harmless=(10, 10.0), level=Level.ERROR),
    "optimizer.params.min_coeff": Rule("zerorun's Lamb clamps its trust ratio to at least 0.01, DeepSpeed's "
                                       "default; pass zerorun.Lamb(params, min_coeff=...) to "
                                       "deepspeed.initialize(optimizer=) for another", harmless=(0.01,),
                                       level=Level.ERROR),
    "optimizer.params.lr": Rule("optimizer.lr", target="optimizer.lr", convert=float),
    "optimizer.params.betas": Rule("optimizer.betas", target="optimizer.betas", convert=lambda v: [float(b) for b in v]),
    "optimizer.params.eps": Rule("optimizer.eps", target="optimizer.eps", convert=float),
    "optimizer.params.weight_decay": Rule("optimizer.weight_decay (DeepSpeed's default 0)",
                                          target="optimizer.weight_decay", convert=float),
    "optimizer.params.adam_w_mode": Rule("false: optimizer.type adam (L2 added to the gradient)", handled=True),
    "optimizer.params.torch_adam": Rule("zerorun's own Adam kernel matches torch's Adam(W) either way"),
    "optimizer.params.bias_correction": Rule("a config's Adam and Lamb correct the bias; pass torch's or "
                                             "zerorun.Lamb(bias_correction=False) to deepspeed.initialize(optimizer=) "
                                             "for another", harmless=(True,), level=Level.ERROR),
    "optimizer.params.amsgrad": Rule("the recipe has no amsgrad: pass torch.optim.AdamW(params, amsgrad=True) to "
                                     "deepspeed.initialize(optimizer=...), which zerorun runs exactly",
                                     harmless=(False,), level=Level.ERROR),
    "optimizer.params.fused": Rule("zerorun picks its fused kernel itself"),
    "optimizer.params.foreach": Rule("zerorun picks its fused kernel itself"),
    # --- scheduler: DeepSpeed's formulas in zerorun.runtime.optim.schedules
    "scheduler.type": Rule("scheduler.type (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)",
                           handled=True),
    **{f"scheduler.params.{name}": Rule(f"scheduler.{name}", target=f"scheduler.{name}") for name in (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps", "warmup_min_ratio",
        "cos_min_ratio", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
        "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size",
        "cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate", "lr_range_test_min_lr",
        "lr_range_test_step_size", "lr_range_test_step_rate", "lr_range_test_staircase")},
    "scheduler.params.last_batch_iteration": Rule("a resumed run restores the schedule from its checkpoint",
                                                  harmless=(-1,), level=Level.ERROR),
    # --- ZeRO
    "zero_optimization.stage": Rule("zero.stage (DeepSpeed's default 0)", target="zero.stage", convert=_stage),
    "zero_optimization.overlap_comm": Rule("zero.overlap_comm", target="zero.overlap_comm", convert=bool),
    "zero_optimization.reduce_bucket_size": Rule("zero.bucket_mb (elements x 4 bytes)", target="zero.bucket_mb",
                                                 convert=_elements_to_mib),
    "zero_optimization.allgather_bucket_size": Rule("zero.allgather_bucket_mb (elements x 4 bytes)",
                                                    target="zero.allgather_bucket_mb", convert=_elements_to_mib),
    "zero_optimization.contiguous_gradients": Rule("zerorun always reduces from contiguous flat buckets"),
    "zero_optimization.reduce_scatter": Rule("zerorun always reduce-scatters (stages 1-3)", harmless=(True,),
                                             level=Level.WARNING),
    "zero_optimization.allgather_partitions": Rule("zerorun always all-gathers updated shards", harmless=(True,),
                                                   level=Level.WARNING),
    "zero_optimization.use_multi_rank_bucket_allreduce": Rule("zerorun reduces one bucket per collective"),
    "zero_optimization.round_robin_gradients": Rule("zerorun lays gradients out in backward order",
                                                    level=Level.WARNING, harmless=(False,)),
    "zero_optimization.load_from_fp32_weights": Rule("zerorun's checkpoints always restore the fp32 master"),
    "zero_optimization.elastic_checkpoint": Rule("zerorun's checkpoints load on any world size and stage"),
    "zero_optimization.ignore_unused_parameters": Rule("unused parameters get zero gradients in zerorun",
                                                      harmless=(True,), level=Level.WARNING),
    "zero_optimization.sub_group_size": Rule("zerorun steps each rank's flat shard in offload tiles of "
                                             "zero.offload_optimizer.buffer_mb", level=Level.WARNING),
    "zero_optimization.stage3_prefetch_bucket_size": Rule("zerorun prefetches whole units: zero.prefetch_units",
                                                          level=Level.WARNING),
    "zero_optimization.stage3_param_persistence_threshold": Rule(
        "zero.param_persistence_threshold (elements)", target="zero.param_persistence_threshold", convert=int),
    "zero_optimization.stage3_model_persistence_threshold": Rule("zerorun applies the per-parameter threshold only",
                                                                 level=Level.WARNING),
    "zero_optimization.stage3_max_live_parameters": Rule("zerorun holds the computing unit and zero.prefetch_units "
                                                         "ahead of it", level=Level.WARNING),
    "zero_optimization.stage3_max_reuse_distance": Rule("zerorun releases a unit after its forward and after its "
                                                        "backward", level=Level.WARNING),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": Rule(
        "engine.state_dict() consolidates the full weights; `zerorun checkpoint consolidate` too",
        level=Level.WARNING, harmless=(False,)),
    "zero_optimization.gather_16bit_weights_on_model_save": Rule(
        "engine.state_dict() consolidates the full weights; `zerorun checkpoint consolidate` too",
        level=Level.WARNING, harmless=(False,)),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": Rule(
        "engine.state_dict() consolidates the full weights; `zerorun checkpoint consolidate` too",
        level=Level.WARNING, harmless=(False,)),
    "zero_optimization.cpu_offload": Rule("DeepSpeed's old spelling of offload_optimizer.device: cpu", handled=True),
    "zero_optimization.cpu_offload_param": Rule("DeepSpeed's old spelling of offload_param.device: cpu", handled=True),
    "zero_optimization.cpu_offload_use_pin_memory": Rule("zero.offload_*.pin_memory", handled=True),
    **{f"zero_optimization.{kind}.{key}": rule for kind in ("offload_optimizer", "offload_param") for key, rule in {
        "device": Rule(f"zero.{kind}.device", target=f"zero.{kind}.device", convert=_device),
        "nvme_path": Rule(f"zero.{kind}.nvme_path", target=f"zero.{kind}.nvme_path", convert=str),
        "pin_memory": Rule(f"zero.{kind}.pin_memory", target=f"zero.{kind}.pin_memory", convert=bool),
        "buffer_count": Rule("zerorun's swap ring has a fixed depth", level=Level.WARNING),
        "buffer_size": Rule("zerorun streams in tiles of zero.offload_*.buffer_mb", level=Level.WARNING),
        "max_in_cpu": Rule("zerorun keeps no NVMe-offloaded parameters cached in host memory", level=Level.WARNING),
        "pipeline_read": Rule("zerorun's NVMe reads are always pipelined with the update"),
        "pipeline_write": Rule("zerorun's NVMe writes are always pipelined with the update"),
        "fast_init": Rule("zerorun writes the initial states to NVMe once", level=Level.WARNING, harmless=(False,)),
        "ratio": Rule("zerorun offloads all of the optimizer states or none", harmless=(1, 1.0), level=Level.WARNING),
        "super_offload": Rule("zerorun's CPU offload is its own", harmless=(False,), level=Level.WARNING),
        "cpuadam_cores_perc": Rule("zerorun's CPU Adam uses the worker's OpenMP threads", level=Level.WARNING),
    }.items()},
    "zero_optimization.zero_hpz_partition_size": Rule("zero.hpz_partition_size (hpZ)",
                                                      target="zero.hpz_partition_size", convert=int),
    "zero_optimization.zero_quantized_weights": Rule("zero.quantized_weights (qwZ)",
                                                     target="zero.quantized_weights", convert=bool),
    "zero_optimization.zero_quantized_nontrainable_weights": Rule("zerorun gathers full-precision weights",
                                                                  harmless=(False,), level=Level.ERROR),
    "zero_optimization.zero_quantized_gradients": Rule("zero.quantized_gradients (qgZ)",
                                                       target="zero.quantized_gradients", convert=bool),
    "zero_optimization.memory_efficient_linear": Rule("zerorun leaves nn.Linear as it is"),
    "zero_optimization.mics_shard_size": Rule("zerorun has no MiCS sharding", harmless=(-1,), level=Level.ERROR),
    "zero_optimization.zenflow": Rule("zerorun has no ZenFlow", section=True, level=Level.ERROR),
    "zero_optimization.leaf_module": Rule("zerorun's units are zero.wrap's classes (or found automatically)",
                                          section=True, level=Level.WARNING),
    "zero_optimization.stage3_module_granularity_threshold": Rule("zerorun's units are zero.wrap's classes",
                                                                  level=Level.WARNING, harmless=(0,)),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": Rule("zerorun gathers with its own all-gather",
                                                                     harmless=(False,), level=Level.WARNING),
    "zero_optimization.stage3_allgather_sequential": Rule("zerorun gathers with its own all-gather",
                                                          harmless=(False,), level=Level.WARNING),
    "zero_optimization.log_trace_cache_warnings": Rule("zerorun re-records a changed unit order and says so"),
    "zero_optimization.enable_sanity_checks": Rule("zerorun always checks its invariants"),
    "zero_optimization.parameter_alignment": Rule("zerorun aligns its flat shards itself"),
    "zero_optimization.legacy_stage1": Rule("zerorun has one stage 1", harmless=(False,), level=Level.WARNING),
    "zero_optimization.override_module_apply": Rule("zerorun.sharded_init() records module init instead"),
    "zero_optimization.pipeline_loading_checkpoint": Rule("zerorun loads checkpoints shard by shard anyway"),
    "zero_optimization.compute_grad_norm": Rule("zerorun always computes the global gradient norm"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": Rule("zerorun keeps Muon's momentum with the rank "
                                                                  "that owns its matrix (the owner way)"),
    # --- NVMe I/O
    "aio.block_size": Rule("zero.aio.block_size", target="zero.aio.block_size", convert=int),
    "aio.queue_depth": Rule("zero.aio.queue_depth", target="zero.aio.queue_depth", convert=int),
    "aio.thread_count": Rule("zero.aio.threads", target="zero.aio.threads", convert=int),
    "aio.intra_op_parallelism": Rule("zero.aio.threads", target="zero.aio.threads", convert=int),
    "aio.single_submit": Rule("zerorun submits a queue's requests together"),
    "aio.overlap_events": Rule("zerorun overlaps I/O submission and completion"),
    "aio.use_gds": Rule("zerorun reads NVMe into host buffers (no GPUDirect Storage)", harmless=(False,),
                        level=Level.WARNING),
    # --- what does not change training: zerorun's equivalent, or a warning naming it
    "tensorboard": Rule(_TELEMETRY, section=True, level=Level.WARNING),
    "wandb": Rule(_TELEMETRY, section=True, level=Level.WARNING),
    "csv_monitor": Rule(_TELEMETRY, section=True, level=Level.WARNING),
    "comet": Rule(_TELEMETRY, section=True, level=Level.WARNING),
    "flops_profiler": Rule(_TELEMETRY + " (TFLOP/s and MFU included)", section=True, level=Level.WARNING),
    "comms_logger": Rule(_TELEMETRY + " (bytes and time per collective kind included)", section=True,
                         level=Level.WARNING),
    "autotuning": Rule("use `zerorun estimate` (and `zerorun tune`) to choose a stage and offload", section=True,
                       level=Level.WARNING),
    "activation_checkpointing": Rule("checkpoint activations in the model with torch.utils.checkpoint (zerorun "
                                     "supports it at every stage)", section=True, level=Level.WARNING),
    "checkpoint": Rule("zerorun's checkpoints are sharded safetensors with a manifest (recipe: checkpoint.*)",
                       section=True, level=Level.WARNING),
    "compile": Rule("call torch.compile on the model yourself", section=True, level=Level.WARNING),
    # --- features zerorun does not have: refused, they change what is trained
    "elasticity": Rule("zerorun has no elastic batch sizes; fix train_batch_size", section=True, level=Level.ERROR),
    "pipeline": Rule("zerorun has no pipeline parallelism", section=True, level=Level.ERROR),
    "tensor_parallel": Rule("zerorun has no tensor parallelism", section=True, level=Level.ERROR),
    "sequence_parallel_size": Rule("zerorun has no sequence parallelism", harmless=(1,), level=Level.ERROR),
    "compression_training": Rule("zerorun has no compression training", section=True, level=Level.ERROR),
    "quantize_training": Rule("zerorun has no quantized training", section=True, level=Level.ERROR),
    "sparse_attention": Rule("zerorun has no sparse attention kernels", section=True, level=Level.ERROR),
    "curriculum_learning": Rule("zerorun has no curriculum learning; order the data in the script", section=True,
                                level=Level.ERROR),
    "data_efficiency": Rule("zerorun has no data-efficiency pipeline; order the data in the script", section=True,
                            level=Level.ERROR),
    "hybrid_engine": Rule("zerorun has no hybrid (RLHF) engine", section=True, level=Level.ERROR),
    "moe": Rule("zerorun has no expert parallelism", section=True, level=Level.ERROR),
}


def rule_for(key: str) -> tuple[str, Rule] | None:
    """The rule that covers a dotted key: its own, or its nearest section's."""
    if key in RULES:
        return key, RULES[key]
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:cut])
        if parent in RULES and RULES[parent].section:
            return parent, RULES[parent]
    return None


def reference_markdown() -> str:
    """docs/deepspeed.md's table of DeepSpeed keys: what each becomes in zerorun."""
    out = ["| DeepSpeed key | in zerorun | if not harmless |", "|---|---|---|"]
    for key, rule in RULES.items():
        shown = f"`{key}`" + (" (section)" if rule.section else "")
        if rule.target or rule.handled:
            effect = "mapped"
        else:
            effect = {Level.INFO: "accepted", Level.WARNING: "warning", Level.ERROR: "**refused**"}[rule.level]
        if rule.harmless:
            effect += " (fine: " + ", ".join(_json(v) for v in rule.harmless) + ")"
        out.append(f"| {shown} | {rule.why} | {effect} |")
    return "\n".join(out) + "\n"


def _json(value: Any) -> str:
    import json

    return f"`{json.dumps(value)}`"
