"""What `zerorun checkpoint info|consolidate|upgrade` do with a checkpoint, without a process group or an engine:
describe it (and verify every file), gather its shards into one state dict, upgrade an older manifest."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from zerorun.errors import ZerorunError
from zerorun.runtime.checkpoint.files import (
    EXTRAS,
    MANIFEST,
    Checkpoint,
    latest_tag,
    numel_of,
    shard_file,
    tags,
    write_manifest,
)
from zerorun.runtime.checkpoint.manifest import SEALED_VERSIONS, UNSEALED_VERSION, VERSION


def consolidate(directory: str | os.PathLike, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 state dict (trainable parameters from the master, buffers and frozen parameters),
    read one saved rank file at a time: it holds the final weights plus one shard's slices."""
    ckpt = Checkpoint.open(Path(directory), tag)
    ckpt.verify()
    m = ckpt.manifest
    full = {n: torch.zeros(e["shape"], dtype=torch.float32) for n, e in m["params"].items()}
    by_rank: dict[int, list[tuple[str, int, int, int, int]]] = defaultdict(list)
    for name, entry in m["params"].items():
        for r, offset, first, n in entry["pieces"]:
            by_rank[r].append((name, entry["group"], offset, first, n))
    for r in sorted(by_rank):
        with ckpt.reading(shard_file(r)) as f:
            sources = {g: ckpt.slice_of(f, r, f"master.{g}") for g in range(len(m["group_numels"]))}
            for name, g, offset, first, n in by_rank[r]:
                full[name].view(-1)[first:first + n] = sources[g][offset:offset + n]
    with ckpt.reading(EXTRAS) as f:
        for name in m["extras"]:
            value = f.get_tensor(name)
            full[name] = value.float() if value.is_floating_point() else value
    for alias, name in m["aliases"].items():
        full[alias] = full[name]
    return {key: full[key] for key in m["keys"]}


def write_state_dict(state: dict[str, torch.Tensor], out: Path) -> None:
    """`.safetensors` (tied tensors stored once per name) or `.pt` (torch.save)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        seen: set[int] = set()
        unique = {}
        for name, t in state.items():
            unique[name] = t.clone() if id(t) in seen else t
            seen.add(id(t))
        save_file(unique, str(out))
    elif out.suffix in (".pt", ".pth", ".bin"):
        torch.save(state, out)
    else:
        raise ZerorunError(f"--out {out}: end it in .safetensors or .pt.")


def describe(directory: str | os.PathLike, tag: str | None = None, verify: bool = False) -> dict[str, Any]:
    """What `zerorun checkpoint info` shows: the chosen checkpoint's manifest summary and the tags beside it,
    after checking the manifest and every file's size and tensors (with `verify`, also every CRC32)."""
    root = Path(directory)
    ckpt = Checkpoint.open(root, tag)
    ckpt.verify(crc=verify)
    return _summary(root, ckpt, "manifest checksum, sizes, tensors" + (" and CRC32s" if verify else
                                                                      " (--verify also reads every CRC32)"))


def _summary(root: Path, ckpt: Checkpoint, checked: str) -> dict[str, Any]:
    m = ckpt.manifest
    client = sorted(m["client_state"]) if isinstance(m.get("client_state"), dict) else []
    return {"path": str(ckpt.path), "tag": ckpt.path.name, "latest": latest_tag(root), "tags": tags(root),
            "global_step": m["global_step"], "world_size": m["world_size"], "stage": m["stage"],
            "precision": m["precision"], "params": sum(numel_of(e["shape"]) for e in m["params"].values()),
            "lr": [g["lr"] for g in m["optimizer"]["param_groups"]], "loss_scale": m["loss_scaler"]["scale"],
            "files": {n: e["bytes"] for n, e in m["files"].items()}, "checked": checked,
            "client_state": "in client_state.pt" if "client_state_file" in m else ", ".join(client) or "empty"}


def upgrade(directory: str | os.PathLike, tag: str | None = None) -> dict[str, Any]:
    """Seal a format-1 checkpoint (no manifest checksum) as the current format, after checking its
    structure and every file's size, tensors and CRC32; what `describe` shows of it."""
    root = Path(directory)
    ckpt = Checkpoint.open(root, tag, unsealed=True)
    file = ckpt.path / MANIFEST
    if ckpt.manifest["version"] in SEALED_VERSIONS:
        raise ZerorunError(f"{file}: already format {ckpt.manifest['version']}, with a checksum; nothing to upgrade.")
    ckpt.verify()
    write_manifest(file, {**ckpt.manifest, "version": VERSION, "upgraded_from": UNSEALED_VERSION})
    return _summary(root, Checkpoint.open(root, tag), f"upgraded from format {UNSEALED_VERSION}: structure, sizes, "
                                                      "tensors and CRC32s checked, checksum added")


def render(info: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=info["path"], show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [("tag", f"{info['tag']}{' (latest)' if info['tag'] == info['latest'] else ''}"),
            ("tags here", f"{', '.join(info['tags'])}; latest: {info['latest']}"),
            ("step", str(info["global_step"])), ("world size", f"{info['world_size']} ranks"),
            ("ZeRO stage", str(info["stage"])), ("precision", info["precision"]),
            ("trainable parameters", f"{info['params']:,}"),
            ("learning rate", ", ".join(f"{lr:g}" for lr in info["lr"]) + " (per param group)" * (len(info["lr"]) > 1)),
            *([("loss scale", f"{info['loss_scale']:g}")] if info["precision"] == "fp16" else []),
            ("client_state", info["client_state"]), ("checked", info["checked"])]
    rows += [(name, f"{nbytes:,} bytes") for name, nbytes in info["files"].items()]
    rows.append(("total", f"{sum(info['files'].values()):,} bytes"))
    for row in rows:
        table.add_row(*row)
    return table
