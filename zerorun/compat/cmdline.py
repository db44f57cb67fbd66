"""DeepSpeed's command line on `zerorun launch`: a script instead of a recipe, and its batch rule.

    deepspeed     --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
    zerorun launch --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json
    zerorun launch --num_gpus 2 train.py --deepspeed ds.json      # transformers' TrainingArguments form

Everything after the `.py` belongs to the script, as with DeepSpeed's launcher (`split_script_args`).
The command line becomes a recipe file, kept as `runs/<script name>/launch-recipe.yaml` so the run
can be repeated or edited (`script_recipe`): the script and its arguments, the `--deepspeed_config`
(or transformers' `--deepspeed ds.json`) among them as the recipe's `deepspeed_config`, and
`launch.deepspeed_compat: true`.

A DeepSpeed config that gives `train_batch_size` needs the world size to split it into micro-batch
and accumulation. The launcher knows the world size once it has chosen the nodes; `batch_overrides`
then gives the `--set` overrides that finish the split the DeepSpeed way, and checks the result.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path

import yaml

from zerorun import config
from zerorun.config import ds_config
from zerorun.errors import ConfigError

RECIPE_NAME = "launch-recipe.yaml"
CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")
HF_FLAG = "--deepspeed"  # transformers' TrainingArguments.deepspeed: a path right after it (DeepSpeed's is a flag)


def split_script_args(args: Sequence[str], value_options: Collection[str]) -> tuple[list[str], list[str]]:
    """(launcher arguments up to and including the first `.py`, the script's arguments after it)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-"):
            i += 2 if arg in value_options else 1  # `--opt value`; `--opt=value` and flags are one token
            continue
        if arg.endswith(".py"):
            return list(args[:i + 1]), list(args[i + 1:])
        i += 1
    return list(args), []


def deepspeed_config_arg(script_args: Sequence[str]) -> str | None:
    """The value of `--deepspeed_config X` / `--deepspeed_config=X` among the script's arguments, or
    transformers' `--deepspeed X.json` / `--deepspeed=X.json`."""
    for i, arg in enumerate(script_args):
        following = script_args[i + 1] if i + 1 < len(script_args) else None
        for flag in CONFIG_FLAGS:
            if arg == flag and following is not None:
                return following
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        if arg == HF_FLAG and following is not None and following.lower().endswith(".json"):
            return following
        if arg.startswith(HF_FLAG + "=") and arg.lower().endswith(".json"):
            return arg.split("=", 1)[1]
    return None


def script_recipe(script: Path, script_args: Sequence[str], local_rank_arg: bool = True,
                  runs_dir: str | os.PathLike = "runs") -> Path:
    """Write the recipe a `zerorun launch script.py ARGS` command line stands for; return its path."""
    if not script.is_file():
        raise ConfigError(f"{script}: no such script (zerorun launch takes a recipe .yaml or a .py script).")
    name = script.stem
    data: dict = {"script": str(script.resolve()), "args": list(script_args), "name": name,
                  "launch": {"deepspeed_compat": True, "deepspeed_local_rank": local_rank_arg}}
    ds_path = deepspeed_config_arg(script_args)
    if ds_path is not None:
        data["deepspeed_config"] = str(Path(ds_path).resolve())
    out = Path(runs_dir) / name / RECIPE_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# `zerorun launch {script} ...` as a recipe (written by zerorun; repeat the run with\n"
              f"# `zerorun launch {out}`). The script's --deepspeed_config is read as the recipe's deepspeed_config.\n")
    out.write_text(header + yaml.safe_dump(data, sort_keys=False))
    return out


def batch_overrides(recipe_path: str | os.PathLike, overrides: Sequence[str], world_size: int) -> list[str]:
    """`--set` overrides that split a DeepSpeed train_batch_size for `world_size` workers (DeepSpeed's
    rule), leaving alone what the recipe or `--set` gives itself; ConfigError when the split is impossible
    or the recipe's batch keys disagree with train.global_batch_size."""
    recipe = config.load(recipe_path, overrides, check_script=False)
    extra: list[str] = []
    if recipe.deepspeed_config is not None:
        batch = ds_config.translate(ds_config.load_json(recipe.deepspeed_config)).batch
        if batch.needs_world:
            try:
                micro, accum, _ = batch.resolve(world_size)
            except ValueError as exc:
                raise ConfigError(f"{recipe.deepspeed_config}: train_batch_size: {exc} "
                                  f"({world_size} workers).") from None
            given = _given_train_keys(Path(recipe_path), overrides)
            extra += [f"train.micro_batch_size={micro}"] if "micro_batch_size" not in given else []
            extra += [f"train.grad_accum_steps={accum}"] if "grad_accum_steps" not in given else []
    final = config.load(recipe_path, [*extra, *overrides], check_script=False) if extra else recipe
    config.check_global_batch(final, world_size)
    return extra


def _given_train_keys(recipe_path: Path, overrides: Sequence[str]) -> set[str]:
    """The `train.*` keys the recipe file or a `--set` names itself (those win over the DeepSpeed config)."""
    data = yaml.safe_load(recipe_path.read_text()) or {}
    train = data.get("train") if isinstance(data, dict) else None
    given = set(train) if isinstance(train, dict) else set()
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.startswith("train."):
            given.add(key.removeprefix("train."))
    return given

