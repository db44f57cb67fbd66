"""A consolidated state dict as a Hugging Face model directory (`zerorun checkpoint consolidate --format hf`).

    out/config.json                       (copied: the model's transformers config)
    out/model.safetensors                 (or, past the shard size:)
    out/model-00001-of-00003.safetensors ... + out/model.safetensors.index.json

What `from_pretrained(out)` reads without zerorun: safetensors files with `{"format": "pt"}` metadata,
and the index (`metadata.total_size`, `weight_map`: tensor name -> file) when there are several. A
weight tied to an earlier one (the same tensor under two names, e.g. `lm_head.weight`) is written
once, under its first name, as `save_pretrained` does; loading ties it again. The transformers config
comes from `--config` or, by default, the `config.json` that the Trainer writes beside its checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from zerorun.errors import ZerorunError

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SIDE_FILES = ("generation_config.json",)  # copied along with config.json when present beside it


def find_config(checkpoint_dir: Path, given: Path | None) -> Path:
    """The transformers config.json to copy: `given` (a file or a directory holding one), else the
    checkpoint directory's or its parent's."""
    candidates = [given, given / "config.json"] if given is not None else [checkpoint_dir / "config.json",
                                                                           checkpoint_dir.parent / "config.json"]
    for path in candidates:
        if path is not None and path.is_file():
            return path
    where = str(given) if given is not None else f"{checkpoint_dir} or its parent"
    raise ZerorunError(f"--format hf: no config.json in {where}; pass --config with the model's config.json "
                       "(or the directory save_pretrained wrote).")


def write(state: dict[str, torch.Tensor], out: Path, config: Path, max_shard_bytes: int) -> list[Path]:
    """Write the model directory; return the weight files written."""
    from safetensors.torch import save_file

    if max_shard_bytes < 1:
        raise ZerorunError(f"--max-shard-mb must be positive, got {max_shard_bytes} bytes.")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config, out / "config.json")
    for name in SIDE_FILES:
        if (config.parent / name).is_file():
            shutil.copyfile(config.parent / name, out / name)
    shards = _shards(_untied(state), max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / WEIGHTS), metadata={"format": "pt"})
        return [out / WEIGHTS]
    files, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        files.append(out / name)
    total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor once, under its first name; every tensor contiguous (safetensors requires it)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor.contiguous()
    return out


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `max_bytes` each (a larger tensor alone in its group)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards
