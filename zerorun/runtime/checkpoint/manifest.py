"""A checkpoint's manifest, checked before anything trusts it: a checksum of its content, then its structure.

A load, `zerorun checkpoint info` and `consolidate` act on what the manifest says: which elements
of which file belong to which parameter, the step, the hyper-parameters, the loss scale, the RNG
states. The shard files are covered by the CRC32s the manifest lists; the manifest itself by the
SHA-256 of its canonical JSON (sorted keys, no whitespace), stored in it under "sha256". An edit
by hand or a damaged byte is then an error naming the file, not a run that resumes from a wrong
step or learning rate. The structure is checked as well, since a checksum only proves that the
manifest is what some writer wrote: types and ranges, every piece inside its parameter and its
rank file, the pieces of a parameter tiling it exactly once, no element of a rank file claimed
twice, the file list exactly the files such a checkpoint has, RNG states their generators accept.

Format version 1 (zerorun before these checks) has no checksum, so nothing can tell an edited
value from a saved one: it is refused, with the command that upgrades it after checking the
structure and every file's CRC32 (`zerorun checkpoint upgrade`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, NoReturn

import torch

from zerorun.errors import ZerorunError

FORMAT, VERSION, UNSEALED_VERSION = "zerorun-checkpoint", 3, 1
SEALED_VERSIONS = (2, 3)  # 3: any optimizer's state (`optimizer.groups`, `optimizer.owned`); 2: Adam(W)'s only
MANIFEST, LATEST, EXTRAS, CLIENT_STATE = "manifest.json", "latest", "model-extras.safetensors", "client_state.pt"
CHECKSUM = "sha256"
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")  # version 2's flat fp32 tensors of a rank file, per param group
PRECISIONS = ("fp32", "bf16", "fp16")
WAYS = ("fused-adam", "elementwise", "owner")  # optim/ways.py's `Way` values
REQUIRED = ("global_step", "skipped_steps", "world_size", "stage", "precision", "shards", "group_numels",
            "optimizer", "loss_scaler", "params", "extras", "keys", "aliases", "rng", "files")


def shard_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# -- integrity ------------------------------------------------------------------------------------
def checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest without its checksum, as canonical JSON (formatting does not count)."""
    body = {key: value for key, value in manifest.items() if key != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with its checksum."""
    return {**manifest, CHECKSUM: checksum(manifest)}


def check_integrity(file: Path, manifest: dict[str, Any]) -> None:
    """The manifest is as its writer sealed it, or a ZerorunError saying why not."""
    if manifest.get(CHECKSUM) is None:
        raise ZerorunError(f"{file}: no {CHECKSUM} checksum; the manifest is damaged.")
    if manifest[CHECKSUM] != checksum(manifest):
        raise ZerorunError(f"{file}: its content does not match its {CHECKSUM} checksum: the manifest was edited or "
                           "damaged after it was written, and a load would trust the wrong step, hyper-parameters or "
                           "file offsets. Resume from another checkpoint (`zerorun checkpoint info DIR` lists them).")


# -- structure --------------------------------------------------------------------------------------
def validate(file: Path, m: dict[str, Any]) -> None:
    """Raise a ZerorunError naming `file` and the key of the first thing in `m` a load could not trust."""
    missing = [key for key in REQUIRED if key not in m]
    if missing:
        raise ZerorunError(f"{file}: no {', '.join(missing)}; the manifest is damaged.")
    world = _int(file, "world_size", m["world_size"], lo=1)
    stage = _int(file, "stage", m["stage"], lo=0, hi=3)
    _choice(file, "precision", m["precision"], PRECISIONS)
    shards = _int(file, "shards", m["shards"], lo=1 if stage == 0 else world, hi=1 if stage == 0 else world)
    step = _int(file, "global_step", m["global_step"])
    _int(file, "skipped_steps", m["skipped_steps"], hi=step)
    numels = [_int(file, f"group_numels[{g}]", n) for g, n in enumerate(_list(file, "group_numels", m["group_numels"]))]
    _validate_optimizer(file, m["optimizer"], len(numels), step)
    scaler = _dict(file, "loss_scaler", m["loss_scaler"])
    _number(file, "loss_scaler.scale", scaler.get("scale"), lo=0.0, lo_open=True)
    _int(file, "loss_scaler.good_steps", scaler.get("good_steps"))
    _validate_params(file, _dict(file, "params", m["params"]), numels, shards)
    _validate_names(file, m)
    _validate_files(file, m, shards)
    rng = _list(file, "rng", m["rng"])
    if len(rng) != world:
        _fail(file, "rng", f"{len(rng)} entries", f"one per rank ({world})")
    for r, state in enumerate(rng):
        _validate_rng(file, f"rng[{r}]", state)


def optimizer_groups(m: dict[str, Any]) -> list[dict[str, Any]]:
    """Per param group: its optimizer's class, way, flat kinds and scalars, from either version's manifest."""
    opt = m["optimizer"]
    if "groups" in opt:
        groups: list[dict[str, Any]] = opt["groups"]
        return groups
    cls = "AdamW" if opt["decoupled"] else "Adam"  # version 2: zerorun's fused Adam(W) only
    return [{"class": cls, "way": "fused-adam", "kinds": list(STATE_KINDS[1:]),
             "scalars": {"step": {"tensor": "float32", "value": float(n)}} if n else None} for n in opt["steps"]]


def rank_file_tensors(m: dict[str, Any], rank: int) -> dict[str, tuple[str, list[int]]]:
    """The tensors saved rank `rank`'s file holds: name -> (torch dtype name, shape)."""
    out = {f"{kind}.{g}": ("float32", [numel]) for g, (group, numel) in enumerate(zip(optimizer_groups(m),
           m["group_numels"])) for kind in (STATE_KINDS[0], *group["kinds"])}
    for name, entry in m["optimizer"].get("owned", {}).items():
        if entry["rank"] == rank:
            out.update({f"owned.{name}.{key}": (e["tensor"], e["shape"]) for key, e in entry["state"].items()
                        if "shape" in e})
    return out


def _validate_optimizer(file: Path, value: Any, groups: int, step: int) -> None:
    opt = _dict(file, "optimizer", value)
    if "groups" in opt:
        _validate_groups(file, opt, groups, step)
    else:  # version 2
        if not isinstance(opt.get("decoupled"), bool):
            _fail(file, "optimizer.decoupled", opt.get("decoupled"), "true or false")
        for g, n in enumerate(_list(file, "optimizer.steps", opt.get("steps"), length=groups)):
            _int(file, f"optimizer.steps[{g}]", n, hi=step)
    for g, group in enumerate(_list(file, "optimizer.param_groups", opt.get("param_groups"), length=groups)):
        key = f"optimizer.param_groups[{g}]"
        group = _dict(file, key, group)
        if "params" in group:
            _fail(file, f"{key}.params", group["params"], "no parameter list (params say where they are)")
        if "lr" not in group:
            raise ZerorunError(f"{file}: {key} has no lr, so a resume could not restore it (zerorun saves "
                               "hyper-parameters that are JSON numbers; one held as a tensor is not saved).")
        _number(file, f"{key}.lr", group.get("lr"), lo=0.0)
        for name in ("eps", "weight_decay"):
            if isinstance(group.get(name), (int, float)):
                _number(file, f"{key}.{name}", group.get(name), lo=0.0)
        if "betas" in group:
            for i, beta in enumerate(_list(file, f"{key}.betas", group.get("betas"), length=2)):
                _number(file, f"{key}.betas[{i}]", beta, lo=0.0, hi=1.0, hi_open=True)


def _validate_groups(file: Path, opt: dict[str, Any], groups: int, step: int) -> None:
    for g, group in enumerate(_list(file, "optimizer.groups", opt.get("groups"), length=groups)):
        key = f"optimizer.groups[{g}]"
        group = _dict(file, key, group)
        if not isinstance(group.get("class"), str):
            _fail(file, f"{key}.class", group.get("class"), "the optimizer's class name")
        _choice(file, f"{key}.way", group.get("way"), WAYS)
        kinds = _list(file, f"{key}.kinds", group.get("kinds"))
        if not all(isinstance(k, str) and k and "." not in k for k in kinds) or STATE_KINDS[0] in kinds:
            _fail(file, f"{key}.kinds", kinds, "names of state kinds (not master)")
        if group.get("scalars") is not None:
            steps = _dict(file, f"{key}.scalars", group["scalars"]).get("step")
            if steps is not None:  # a group cannot have stepped more often than the engine
                _number(file, f"{key}.scalars.step", _dict(file, f"{key}.scalars.step", steps).get("value"), lo=0.0,
                        hi=float(step))
    for name, entry in _dict(file, "optimizer.owned", opt.get("owned", {})).items():
        entry = _dict(file, f"optimizer.owned[{name!r}]", entry)
        _int(file, f"optimizer.owned[{name!r}].rank", entry.get("rank"))
        for k, e in _dict(file, f"optimizer.owned[{name!r}].state", entry.get("state")).items():
            if "shape" in _dict(file, f"optimizer.owned[{name!r}].state[{k!r}]", e):
                _dtype(file, f"optimizer.owned[{name!r}].state[{k!r}].tensor", e.get("tensor"))
                _shape_numel(file, f"optimizer.owned[{name!r}].state[{k!r}].shape", e["shape"])


def _validate_params(file: Path, params: dict[str, Any], numels: list[int], shards: int) -> None:
    """Each parameter's pieces lie inside it and inside their rank file and tile it exactly once;
    no two pieces share an element of a rank file."""
    claimed: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for name, entry in params.items():
        key = f"params[{name!r}]"
        entry = _dict(file, key, entry)
        numel = _shape_numel(file, f"{key}.shape", entry.get("shape"))
        _dtype(file, f"{key}.dtype", entry.get("dtype"))
        group = _int(file, f"{key}.group", entry.get("group"), hi=len(numels) - 1)
        covered = 0
        pieces = _list(file, f"{key}.pieces", entry.get("pieces"))
        for i, piece in sorted(enumerate(pieces), key=lambda indexed: _first_element(indexed[1])):
            where = f"{key}.pieces[{i}]"
            r, offset, first, n = _list(file, where, piece, length=4)
            _int(file, f"{where} rank", r, hi=shards - 1)
            _int(file, f"{where} length", n, lo=1)
            _int(file, f"{where} file offset", offset, hi=numels[group] - n)
            if type(first) is not int or first != covered:
                _fail(file, f"{where} first element", first, f"{covered}, the element after the previous piece")
            covered = first + n
            claimed.setdefault((r, group), []).append((offset, offset + n, name))
        if covered != numel:
            _fail(file, f"{key}.pieces", f"elements 0..{covered}", f"pieces covering all {numel} elements exactly once")
    for (r, group), spans in claimed.items():
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise ZerorunError(f"{file}: {a} and {b} both claim element {start} of {STATE_KINDS[0]}.{group} in "
                                   f"{shard_file(r)}; the manifest is damaged.")


def _first_element(piece: Any) -> int:
    return piece[2] if isinstance(piece, list) and len(piece) == 4 and type(piece[2]) is int else -1


def _validate_names(file: Path, m: dict[str, Any]) -> None:
    """extras typed; every state dict key a parameter, an extra or an alias of one (consolidate writes them)."""
    extras = _dict(file, "extras", m["extras"])
    for name, entry in extras.items():
        entry = _dict(file, f"extras[{name!r}]", entry)
        _shape_numel(file, f"extras[{name!r}].shape", entry.get("shape"))
        _dtype(file, f"extras[{name!r}].dtype", entry.get("dtype"))
        if name in m["params"]:
            _fail(file, f"extras[{name!r}]", name, "a name that is not also a trainable parameter")
    aliases = _dict(file, "aliases", m["aliases"])
    saved = m["params"].keys() | extras.keys()
    for alias, target in aliases.items():
        if target not in saved:
            _fail(file, f"aliases[{alias!r}]", target, "a parameter or buffer the checkpoint holds")
    keys = _list(file, "keys", m["keys"])
    if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        _fail(file, "keys", keys[:5], "distinct state dict keys")
    unknown = [k for k in keys if k not in saved and k not in aliases]
    if unknown:
        _fail(file, "keys", unknown[:3], "state dict keys the checkpoint holds (a parameter, a buffer or an alias)")


def _validate_files(file: Path, m: dict[str, Any], shards: int) -> None:
    """The file list is exactly this checkpoint's files: nothing missing, nothing outside the directory."""
    files = _dict(file, "files", m["files"])
    expected = {shard_file(r) for r in range(shards)} | {EXTRAS}
    if "client_state_file" in m:
        _choice(file, "client_state_file", m["client_state_file"], (CLIENT_STATE,))
        expected.add(CLIENT_STATE)
    if set(files) != expected:
        odd = sorted(set(files) ^ expected)
        kinds = f"{shards} rank file(s), {EXTRAS}" + (f", {CLIENT_STATE}" if CLIENT_STATE in expected else "")
        _fail(file, "files", odd[:4], f"exactly this checkpoint's files ({kinds}); these differ")
    for name, entry in files.items():
        entry = _dict(file, f"files[{name!r}]", entry)
        _int(file, f"files[{name!r}].bytes", entry.get("bytes"))
        _int(file, f"files[{name!r}].crc32", entry.get("crc32"), hi=2**32 - 1)


def _validate_rng(file: Path, key: str, value: Any) -> None:
    """The RNG states restore into fresh generators (the process's own are touched only by a load)."""
    state = _dict(file, key, value)
    try:
        torch.Generator().set_state(_bytes(state["torch"]))
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        for i, cuda in enumerate(state.get("cuda", [])):
            _bytes(cuda)
        if "numpy" in state:
            _numpy_state(state["numpy"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        reason = str(exc).split(". ")[0][:100]
        raise ZerorunError(f"{file}: {key} is not an RNG state the generators accept ({type(exc).__name__}: "
                           f"{reason}); the manifest is damaged.") from None


def _numpy_state(value: Any) -> None:
    try:
        import numpy
    except ImportError:
        return
    name, keys, pos, has_gauss, cached = value
    numpy.random.RandomState().set_state((name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def _bytes(text: Any) -> torch.Tensor:
    if not isinstance(text, str):
        raise TypeError("not base64 text")
    return torch.tensor(list(base64.b64decode(text, validate=True)), dtype=torch.uint8)


# -- typed values -----------------------------------------------------------------------------------
def _fail(file: Path, key: str, value: Any, expected: str) -> NoReturn:
    shown = value if isinstance(value, str) and " " in value else json.dumps(value, default=str)
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    raise ZerorunError(f"{file}: {key} is {shown}, expected {expected}; the manifest is damaged.")


def _int(file: Path, key: str, value: Any, lo: int = 0, hi: int | None = None) -> int:
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bound = f"an integer >= {lo}" if hi is None else f"{lo}" if lo == hi else f"an integer in {lo}..{hi}"
        _fail(file, key, value, bound)
    return value


def _number(file: Path, key: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False,
            hi_open: bool = False) -> float:
    ok = type(value) in (int, float) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        upper = "" if hi == math.inf else f" and {'<' if hi_open else '<='} {hi}"
        _fail(file, key, value, f"a finite number {'>' if lo_open else '>='} {lo}{upper}")
    return float(value)


def _choice(file: Path, key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        _fail(file, key, value, " or ".join(choices))
    return str(value)


def _list(file: Path, key: str, value: Any, length: int | None = None) -> list:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        _fail(file, key, value, "a list" if length is None else f"a list of {length}")
    return value


def _dict(file: Path, key: str, value: Any) -> dict:
    if not isinstance(value, dict):
        _fail(file, key, value, "an object")
    return value


def _shape_numel(file: Path, key: str, value: Any) -> int:
    numel = 1
    for i, size in enumerate(_list(file, key, value)):
        numel *= _int(file, f"{key}[{i}]", size)
    return numel


def _dtype(file: Path, key: str, value: Any) -> None:
    if not isinstance(value, str) or not isinstance(getattr(torch, value, None), torch.dtype):
        _fail(file, key, value, "a torch dtype name")
