"""`deepspeed.initialize`, `add_config_arguments` and `init_distributed`, on zerorun's engine.

Which configuration a script trains with, in DeepSpeed's order: `args.deepspeed_config` (or the
old `args.deepscale_config`), else `config=` (or `config_params=`); both at once is an error, as
in DeepSpeed. Under `zerorun launch` the launcher's recipe is the base: when the script's config
is the file the launcher already read (`deepspeed_config` of a `.py` launch or of the recipe),
the recipe is used as launched, `--set` overrides included; any other config is translated here,
with the real world size, over the recipe's other keys. With no config at all, a launched recipe
alone is enough (a recipe written by `zerorun convert`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

import zerorun
from zerorun import config as recipes
from zerorun.compat import filled
from zerorun.compat.engine import DeepSpeedEngine
from zerorun.config import Recipe, ds_config
from zerorun.errors import ConfigError, ZerorunError
from zerorun.runtime.comm.dist import DistInfo
from zerorun.runtime.comm.dist import init_distributed as _init_distributed
from zerorun.runtime.engine import Engine
from zerorun.runtime.optim import schedules


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `--deepspeed`, `--deepspeed_config` (and the old `--deepscale*`) arguments."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: Any = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> DistInfo:
    """Join the process group from torchrun's environment (nccl on CUDA, gloo on CPU), as zerorun's worker does."""
    launched = _launched_recipe()
    seconds = timeout.total_seconds() if timeout is not None else launched.launch.timeout_s if launched else 300.0
    return _init_distributed(seconds)


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's initialize: (engine, optimizer, training dataloader or None, lr scheduler or None)."""
    if model is None:
        raise ZerorunError("deepspeed.initialize requires a model.")
    if mpu is not None or mesh_param is not None:
        raise ZerorunError("deepspeed.initialize(mpu=/mesh_param=): zerorun has data parallelism only (no model, "
                           "tensor or sequence parallel groups).")
    source = _config_source(args, config if config is not None else config_params)
    launched = _launched_recipe()
    info = _init_distributed(launched.launch.timeout_s if launched else 300.0)
    recipe, ds = recipe_for(source, launched, info.world_size, info.rank)
    recipes.check_global_batch(recipe, info.world_size)
    _wrap_model_blocks(recipe, model, info.rank)
    user_optimizer = _client_optimizer(optimizer, model_parameters, model, recipe, ds)
    if optimizer is not None and ds is not None and "optimizer" in ds and info.rank == 0:
        print("zerorun: warning: initialize(optimizer=...) is used and the DeepSpeed config's `optimizer` section "
              "is not (as in DeepSpeed).", file=sys.stderr)
    # the engine steps the schedule after every applied update (DeepSpeed's contract), and so saves it in
    # every checkpoint and restores it on resume as its own (runtime/optim/lr_schedules.py)
    # The script drives its own loop: the recipe's train.steps is not its count. A scheduler's total in the config
    # is (the Trainer fills an "auto" total_num_steps with its max_steps); without one no total is known.
    engine = zerorun.start(Engine(model, user_optimizer, recipe, lambda opt: _lr_scheduler(lr_scheduler, opt,
                                                                                           recipe)),
                           total_steps=recipe.scheduler.total_num_steps)
    schedule = engine.lr_schedules.owned
    facade = DeepSpeedEngine(engine, recipe, schedule, ds)
    loader = _dataloader(training_data, recipe, info, collate_fn, ds) if training_data is not None else None
    return facade, engine.optimizer, loader, schedule


def _wrap_model_blocks(recipe: Recipe, model: torch.nn.Module, rank: int) -> None:
    """Stage 3 with no `zero.wrap`: a transformers model's `_no_split_modules` (its repeated blocks) become
    the units, as DeepSpeed shards every layer of such a model; without units nothing would be sharded."""
    blocks = getattr(model, "_no_split_modules", None)
    if recipe.zero.stage != 3 or recipe.zero.wrap or not blocks:
        return
    present = {type(m).__name__ for m in model.modules()}
    recipe.zero.wrap = [name for name in blocks if name in present]
    if rank == 0 and recipe.zero.wrap:
        print(f"zerorun: stage 3 units: {', '.join(recipe.zero.wrap)} (the model's _no_split_modules; set "
              "zero.wrap to choose others)", file=sys.stderr)


def _launched_recipe() -> Recipe | None:
    return recipes.from_env()


def _config_source(args: Any, given: Any) -> str | Mapping[str, Any] | None:
    """The DeepSpeed config the script names: a path, a dict, or None; DeepSpeed's conflicts refused."""
    from_args = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is not None:
        if from_args is not None:
            raise ZerorunError("both --deepscale_config and --deepspeed_config were given; keep --deepspeed_config.")
        from_args = old
    if from_args is not None and given is not None:
        raise ZerorunError("a DeepSpeed config came both from --deepspeed_config and from initialize(config=...); "
                           "give one (DeepSpeed refuses this too).")
    return from_args if from_args is not None else given


def recipe_for(source: str | Mapping[str, Any] | None, launched: Recipe | None, world_size: int,
               rank: int = 0) -> tuple[Recipe, dict[str, Any] | None]:
    """The recipe to train with and the DeepSpeed config dict it came from (None: a recipe alone)."""
    if source is None:
        if launched is None:
            raise ZerorunError("DeepSpeed requires --deepspeed_config (or initialize(config=...)) to specify its "
                               "configuration; under `zerorun launch` a recipe can give it instead.")
        if launched.deepspeed_config is None:
            return launched, None
        ds = ds_config.load_json(launched.deepspeed_config)
        filled.refuse_unfilled(ds_config.translate(ds), launched.deepspeed_config, launched)
        return launched, ds
    if isinstance(source, (str, os.PathLike)):
        path = os.path.realpath(source)
        ds = ds_config.load_json(path)
        if launched is not None and launched.deepspeed_config and os.path.realpath(launched.deepspeed_config) == path:
            filled.refuse_unfilled(ds_config.translate(ds), path, launched)
            return launched, ds
        label = path
    elif isinstance(source, Mapping):
        ds, label = dict(source), "initialize(config=...)"
    else:
        raise ZerorunError(f"a DeepSpeed config is a JSON path or a dict, got {type(source).__name__}.")
    translation = ds_config.translate(ds, world_size)
    ds_config.check(translation, label)
    filled.refuse_unfilled(translation, label, launched)
    base = recipes.to_dict(launched) if launched is not None else {"script": sys.argv[0] or "<script>"}
    _merge_over(base, translation.data)
    lines: dict[str, int | str] = {key: f"{label}: {origin}" for key, origin in translation.origins.items()}
    recipe = recipes.from_dict(base, label, lines)
    recipe.source = launched.source if launched is not None else label
    if rank == 0:  # what the script's config changed: filled "auto"s, and any key of the user's it overrides
        ds_config.report(translation, label)
        for line in filled.lines(ds, translation, label, launched, recipe):
            ds_config.print_once(line)
    return recipe, ds


def _merge_over(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    """`top`'s keys replace `base`'s, section by section."""
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge_over(base[key], value)
        else:
            base[key] = value


def _client_optimizer(optimizer: Any, model_parameters: Any, model: torch.nn.Module, recipe: Recipe,
                      ds: Mapping[str, Any] | None) -> Any:
    """The torch optimizer(s) to hand to zerorun.initialize (None: the recipe's, over every parameter)."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ZerorunError(f"initialize(optimizer=...): expected a torch optimizer or a callable that makes one, "
                               f"got {type(optimizer).__name__}.")
        optimizer = optimizer(model_parameters if model_parameters is not None else model.parameters())
    if optimizer is not None:
        return optimizer
    if ds is not None and "optimizer" not in ds:
        raise ConfigError("no optimizer: the DeepSpeed config has no `optimizer` section and initialize() got no "
                          "optimizer=; add one of them.")
    if model_parameters is None:
        return None
    # The config's optimizer over the script's param groups (e.g. no weight decay for biases).
    from zerorun.runtime.optim.recipe_optimizers import from_recipe

    return from_recipe(recipe.optimizer, model, list(model_parameters))


def _lr_scheduler(client: Any, optimizer: torch.optim.Optimizer, recipe: Recipe) -> Any:
    """DeepSpeed's precedence: the script's scheduler (or a callable making one), else the config's."""
    if client is None:
        return schedules.build(recipe.scheduler, optimizer, recipe.train.steps)
    if not hasattr(client, "step") and callable(client):
        return client(optimizer)
    # A torch scheduler made over the script's own optimizer: point it at the engine's, whose param
    # groups are the ones the update reads (the same count, in the same order).
    bound = getattr(client, "optimizer", None)
    if isinstance(bound, torch.optim.Optimizer) and bound is not optimizer:
        if len(bound.param_groups) != len(optimizer.param_groups):
            raise ZerorunError("lr_scheduler: its optimizer's param groups do not match the engine's.")
        client.optimizer = optimizer
    return client


def _dataloader(dataset: Any, recipe: Recipe, info: DistInfo, collate_fn: Callable | None,
                ds: Mapping[str, Any] | None) -> torch.utils.data.DataLoader:
    """DeepSpeed's training loader: a DistributedSampler over the ranks, micro-batch sized."""
    from torch.utils.data import DataLoader, DistributedSampler

    drop_last = bool((ds or {}).get("dataloader_drop_last", False))
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank)
    return DataLoader(dataset, batch_size=recipe.train.micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                      drop_last=drop_last)
