"""`zerorun convert ds_config.json`: a DeepSpeed config written out as a commented recipe.

Every mapped key carries a comment naming the DeepSpeed key it came from; every key that did not
map is listed at the end with what zerorun does instead (warnings also go to stderr). The recipe is
for the same DeepSpeed-style script: it sets `launch.deepspeed_compat: true`, so the script's
`import deepspeed` gets zerorun's API and `deepspeed.initialize` with no --deepspeed_config uses it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zerorun import config
from zerorun.config import ds_config
from zerorun.config.ds_keys import Level

SECTION_ORDER = ("train", "zero", "precision", "optimizer", "scheduler")


def convert(ds_path: str | os.PathLike, out: Path | None, script: str, world_size: int | None) -> str:
    """The recipe text for `ds_path` (ConfigError naming the JSON file and keys it cannot honour)."""
    translation = ds_config.read(ds_path, world_size)
    if translation.batch.needs_world and world_size is None:
        _refuse_without_world(ds_path, translation.batch)
    if out is not None:  # the recipe's paths are relative to where it is written
        script = os.path.relpath(Path(script).resolve(), out.resolve().parent)
    data = {"script": script, "name": Path(ds_path).stem, "launch": {"deepspeed_compat": True},
            **translation.data}
    text = render(data, translation, str(ds_path))
    config.loads(text, str(out or "<converted recipe>"))  # what we write must load
    return text


def _refuse_without_world(ds_path: Any, batch: ds_config.Batch) -> None:
    from zerorun.errors import ConfigError

    raise ConfigError(f"{ds_path}: train_batch_size: {batch.train_batch_size} is split into micro-batch and "
                      "accumulation by the world size (DeepSpeed's rule); pass --world-size N, or give "
                      "train_micro_batch_size_per_gpu and gradient_accumulation_steps.")


def render(data: dict[str, Any], translation: ds_config.Translation, source: str) -> str:
    """YAML with a `# <DeepSpeed key>` comment on each mapped key and the unmapped keys listed at the end."""
    lines = [f"# Converted from {source} by `zerorun convert`; zerorun's defaults apply to every key not",
             "# written here (see the recipe reference, docs/recipes.md).", ""]
    for key in ("script", "name"):
        lines.append(f"{key}: {json.dumps(data[key])}")
    lines += ["launch:", "  deepspeed_compat: true   # the script's `import deepspeed` gets zerorun's API", ""]
    for section in SECTION_ORDER:
        if section in data:
            lines.append(f"{section}:")
            lines += _section(data[section], section, translation.origins, "  ")
            lines.append("")
    notes = [n for n in translation.notes if n.level is not Level.ERROR]
    if notes:
        lines.append(f"# Keys of {Path(source).name} with no recipe key:")
        lines += [f"#   {n.key}: {n.level.value}: {n.message}" for n in notes]
    if translation.autos:
        lines.append(f"# \"auto\" in {Path(source).name}: zerorun's defaults above, unless the script passes the config "
                     "to deepspeed.initialize after transformers or accelerate filled it in (then their values):")
        lines += [f"#   {key}{f' -> {target}' if target else ''}" for key, target in translation.autos.items()]
    return "\n".join(lines).rstrip() + "\n"


def _section(node: dict[str, Any], prefix: str, origins: dict[str, str], indent: str) -> list[str]:
    out = []
    for key, value in node.items():
        dotted = f"{prefix}.{key}"
        if isinstance(value, dict):
            out.append(f"{indent}{key}:")
            out += _section(value, dotted, origins, indent + "  ")
            continue
        origin = origins.get(dotted)
        comment = f"   # {origin}" if origin else ""
        out.append(f"{indent}{key}: {json.dumps(value)}{comment}")
    return out
