"""What the DeepSpeed config a script passes to `deepspeed.initialize` changed, said once, on rank 0.

A Trainer script's `ds_config.json` says `"auto"` where transformers (and accelerate) fill in the
script's own arguments (`--learning_rate 5e-05` becomes `optimizer.params.lr`) before they call
`deepspeed.initialize(config_params=...)`. At launch the file still says "auto"; what the run trains
with is only known here. So, rather than warning at launch that zerorun's defaults apply (they do not),
this module says what applies:

- the values the script filled in for the launched file's "auto" keys (information);
- a recipe key the user set (in the recipe or with `--set`) that the script's config overrides with
  another value: the script's config wins, as in DeepSpeed (a warning, the only real override).

An "auto" still there when the script calls `deepspeed.initialize` (a script that calls it itself, with
a config written for the Trainer) is refused by `refuse_unfilled`, naming each key and what fills it in
the Trainer, as DeepSpeed refuses it: training on zerorun's defaults instead (a learning rate the user
never chose) would look fine and not be. A recipe key the user gives (`--set optimizer.lr=...`) fills
the "auto" it stands for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerorun.config import Recipe, ds_config
from zerorun.config.load import value_at
from zerorun.errors import ConfigError

# DeepSpeed key -> what transformers' Trainer fills its "auto" with (accelerate: the same from its plugin)
TRAINER_FILLS = {
    "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
    "gradient_accumulation_steps": "--gradient_accumulation_steps",
    "train_batch_size": "world size x --per_device_train_batch_size x --gradient_accumulation_steps",
    "gradient_clipping": "--max_grad_norm",
    "optimizer.params.lr": "--learning_rate",
    "optimizer.params.betas": "--adam_beta1 and --adam_beta2",
    "optimizer.params.eps": "--adam_epsilon",
    "optimizer.params.weight_decay": "--weight_decay",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "--learning_rate",
    "scheduler.params.warmup_num_steps": "--warmup_steps",
    "scheduler.params.total_num_steps": "the number of training steps",
    "fp16.enabled": "--fp16",
    "bf16.enabled": "--bf16",
    "zero_optimization.reduce_bucket_size": "the model's hidden_size",
    "zero_optimization.stage3_prefetch_bucket_size": "the model's hidden_size",
    "zero_optimization.stage3_param_persistence_threshold": "the model's hidden_size",
}


def lines(ds: Mapping[str, Any], translation: ds_config.Translation, label: str, launched: Recipe | None,
          recipe: Recipe) -> list[str]:
    """The lines to print for the script's config `ds` (translated as `translation`, trained as `recipe`)
    over the `launched` recipe."""
    out = []
    filled = _filled(ds, launched)
    if filled:
        assert launched is not None and launched.deepspeed_config is not None
        out.append(f"zerorun: {label}: the script filled in the \"auto\" keys of {launched.deepspeed_config}: "
                   + ", ".join(f"{key} {ds_config.shown_value(value)}" for key, value in filled.items())
                   + "; zerorun trains with these.")
    if launched is not None:
        out += _overridden(translation, label, launched, recipe)
    return out


def refuse_unfilled(translation: ds_config.Translation, label: str, launched: Recipe | None) -> None:
    """A ConfigError when the config the script hands to deepspeed.initialize still says "auto" for a key no
    recipe key of the user's gives: each named with what fills it in the Trainer and the recipe key to set."""
    given = _user_given(launched)
    unfilled = {key: target for key, target in translation.autos.items()
                if not target or not all(t in given for t in target.split(", "))}
    if not unfilled:
        return
    rows = []
    for key, target in unfilled.items():
        fills = TRAINER_FILLS.get(key)
        trainer = f"the Trainer fills it from {fills}" if fills else "transformers or accelerate fill it"
        to_do = f"give a value, or --set {target.split(', ')[0]}=..." if target else "give a value or remove the key"
        rows.append(f"{key}: {trainer}; {to_do}")
    raise ConfigError(
        f"{label}: \"auto\" in {len(unfilled)} key(s) that nothing filled in before deepspeed.initialize. "
        "transformers' Trainer and accelerate fill \"auto\" from the script's own arguments when they call "
        "deepspeed.initialize; a script that calls it itself must give the values (DeepSpeed refuses \"auto\" "
        "too; zerorun would otherwise train on its own defaults, a learning rate you never chose):\n  "
        + "\n  ".join(rows))


def _user_given(launched: Recipe | None) -> set[str]:
    """The recipe keys the user gave in the recipe or with `--set` (not those read from its DeepSpeed file)."""
    if launched is None:
        return set()
    from_file = f"{launched.deepspeed_config}: " if launched.deepspeed_config else None
    return {key for key, where in launched.given.items() if from_file is None or not where.startswith(from_file)}


def _filled(ds: Mapping[str, Any], launched: Recipe | None) -> dict[str, Any]:
    """DeepSpeed key -> the value the script gave it, for each "auto" of the file the job was launched with."""
    if launched is None or launched.deepspeed_config is None:
        return {}
    try:
        autos = ds_config.translate(ds_config.load_json(launched.deepspeed_config)).autos
    except Exception:  # noqa: BLE001 - the file changed or went since the launch: nothing to compare with
        return {}
    values = {key: _get(ds, key) for key in autos}
    return {key: value for key, value in values.items() if value is not None and value != ds_config.AUTO}


def _overridden(translation: ds_config.Translation, label: str, launched: Recipe, recipe: Recipe) -> list[str]:
    """A warning per recipe key the user set that the script's config gives another value."""
    out = []
    given = _user_given(launched)
    for key, origin in translation.origins.items():
        if key not in given:
            continue  # zerorun's default, or the launched DeepSpeed file's own value: nothing the user chose here
        where = launched.given[key]
        before, after = value_at(launched, key), value_at(recipe, key)
        if before != after:
            out.append(f"zerorun: warning: {where} sets {key} = {ds_config.shown_value(before)}, but the DeepSpeed "
                       f"config the script passes to deepspeed.initialize ({label}) says {origin} = "
                       f"{ds_config.shown_value(after)}, which wins (as in DeepSpeed): {key} is "
                       f"{ds_config.shown_value(after)}.")
    return out


def _get(ds: Mapping[str, Any], dotted: str) -> Any:
    node: Any = ds
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node
