"""What the DeepSpeed config a script passes to `deepspeed.initialize` changed, said once, on rank 0.

A Trainer script's `ds_config.json` says `"auto"` where transformers (and accelerate) fill in the
script's own arguments (`--learning_rate 5e-05` becomes `optimizer.params.lr`) before they call
`deepspeed.initialize(config_params=...)`. At launch the file still says "auto"; what the run trains
with is only known here. So, rather than warning at launch that zerorun's defaults apply (they do not),
this module says what applies, in three kinds of line:

- the values the script filled in for the launched file's "auto" keys (information);
- "auto" keys the script's config still has: zerorun's values apply, named with them (a warning);
- a recipe key the user set (in the recipe or with `--set`) that the script's config overrides with
  another value: the script's config wins, as in DeepSpeed (a warning, the only real override).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zerorun.config import Recipe, ds_config
from zerorun.config.load import value_at


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
    if translation.autos:
        targets = {t for target in translation.autos.values() for t in target.split(", ") if t}
        values = {t: value_at(recipe, t) for t in targets}
        out.append(f"zerorun: warning: {label}: still \"auto\" when the script called deepspeed.initialize (nothing "
                   f"filled it in): zerorun's values apply: {ds_config.applied_values(translation.autos, values)}.")
    if launched is not None:
        out += _overridden(translation, label, launched, recipe)
    return out


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
    from_file = f"{launched.deepspeed_config}: " if launched.deepspeed_config else None
    for key, origin in translation.origins.items():
        where = launched.given.get(key)
        if where is None or (from_file is not None and where.startswith(from_file)):
            continue  # zerorun's default, or the launched DeepSpeed file's own value: nothing the user chose here
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
