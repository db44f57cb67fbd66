"""Sharded checkpoints of an engine: every rank saves its own flat state, rank 0 a manifest.

The files are described in `files.py`. A save writes into `DIR/.tmp-<tag>/`: each rank
its `rank-<r>.safetensors` (fsynced; its size and CRC32 recorded); then all ranks meet (an
all-reduce of those sizes: the barrier before the commit); rank 0 writes buffers and frozen
parameters, then the manifest (temporary name, fsync, rename), fsyncs the directory, renames it
to `DIR/<tag>` and only then replaces `latest`. A crash anywhere leaves `latest` naming the previous
complete checkpoint; the next save removes the leftover `.tmp-*` directory.

A load never converts: for every piece of every unit this rank owns *now*, it reads the element
ranges from whichever saved rank files hold them (the manifest says where), one file at a time
through safetensors' lazy slices. So any world size and any stage (0-3) resume from any other.
Before anything is read, every file's size and CRC32 are checked (each CRC by one rank, the
verdict agreed by all) and the manifest is matched against the model, so damage is an error naming
the file, never a wrong load.

A checkpoint composes the state of the parts that own it: the master weights through the store's
`saved_master`/`restore_master` (store.py), the optimizer's state through the update's
`saved_tensors`/`describe`/`load` (optim/update.py): flat kinds laid out like the master
(`<kind>.<group>`), each owned parameter's state whole (`owned.<name>.<key>`), read back at any
world size, stage or way (optimizer_state.py). Where the state lives (device, host, NVMe) is theirs
to know, not a question this module asks.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from zerorun.config import Recipe
from zerorun.errors import ZerorunError
from zerorun.runtime.checkpoint import resume_check
from zerorun.runtime.checkpoint.files import (
    CLIENT_STATE,
    EXTRAS,
    FORMAT,
    LATEST,
    MANIFEST,
    Checkpoint,
    as_entry,
    check_tag,
    clean_crashed_saves,
    fsync_dir,
    os_error,
    prune,
    replace_dir,
    seal,
    shard_file,
    write_atomic,
    write_manifest,
    write_tensors,
)
from zerorun.runtime.checkpoint.manifest import VERSION
from zerorun.runtime.checkpoint.optimizer_state import SavedOptimizerState
from zerorun.runtime.comm.collectives import Collectives
from zerorun.runtime.offload.homes import MASTER
from zerorun.runtime.optim.lr_schedules import LrSchedules
from zerorun.runtime.optim.optimizer import ShardedOptimizer
from zerorun.runtime.optim.update import Update
from zerorun.runtime.partition import range_copies
from zerorun.runtime.precision import LossScaler
from zerorun.runtime.store import ParamStore, first_names, flat_names
from zerorun.version import __version__

log = logging.getLogger("zerorun")

CRASH_ENV = "ZERORUN_CHECKPOINT_CRASH"  # tests only: "<rank>:<point>:<tag>" SIGKILLs that rank there


class Engine(Protocol):
    """What a checkpoint saves and restores of the engine (runtime/engine.py implements it)."""

    recipe: Recipe
    model: nn.Module  # the model as the script built it, under any torch.compile wrapper: its names are saved
    store: ParamStore
    optimizer: ShardedOptimizer
    update: Update
    scaler: LossScaler
    comm: Collectives
    device: torch.device
    stage: int
    global_step: int
    skipped_steps: int
    micro_steps: int
    grad_accum_steps: int
    lr_schedules: LrSchedules


# -- save -----------------------------------------------------------------------------------------
def save(engine: Engine, directory: str | os.PathLike, tag: str, client_state: dict | None) -> Path:
    """Write a checkpoint of `engine` as `directory/tag` (every rank calls this) and point `latest` at it."""
    root, tmp = begin(engine, directory, tag)
    rank, world, shards = engine.comm.rank, engine.comm.world_size, engine.store.shard_world
    sealed = torch.zeros(world, 2, dtype=torch.int64, device=engine.device)
    optimizer = describe_optimizer(engine)  # a collective: before any rank may skip ahead
    if rank < shards:  # stage 0: one copy of the state, rank 0's
        sealed[rank] = torch.tensor(write_tensors(tmp / shard_file(rank), rank_tensors(engine)))
    crash_point("shard", rank, tag)
    engine.comm.all_reduce(sealed, async_op=False).wait()  # every shard is on disk: rank 0 may commit
    rng = gather_rng(engine)
    if rank == 0:
        files = {shard_file(r): {"bytes": int(n), "crc32": int(c)} for r, (n, c) in enumerate(sealed[:shards].tolist())}
        commit(root, tmp, describe(engine, tag, rng, optimizer), files, extras_of(engine.model),
               client_payload(client_state), engine.recipe.checkpoint.keep_last)
    _barrier(engine)
    return root / tag


def begin(engine: Engine, directory: str | os.PathLike, tag: str) -> tuple[Path, Path]:
    """Check that a save may happen now; rank 0 removes crashed saves and makes the temporary directory,
    which every rank may write into once this returns. (checkpoint root, temporary directory)."""
    check_tag(tag)
    if engine.micro_steps % engine.grad_accum_steps:
        raise ZerorunError(f"save_checkpoint at micro-step {engine.micro_steps}: call it after the engine.step() "
                           f"that ends an accumulation window (every {engine.grad_accum_steps} micro-steps), "
                           "or the gradients accumulated so far would be lost.")
    root = Path(directory)
    tmp = root / f".tmp-{tag}"
    if engine.comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            clean_crashed_saves(root)
            tmp.mkdir()
        except OSError as exc:
            raise ZerorunError(f"rank 0: checkpoint {tag} not saved: making {tmp} failed: {os_error(exc)}.") from None
    _barrier(engine)
    return root, tmp


def commit(root: Path, tmp: Path, manifest: dict[str, Any], files: dict[str, dict[str, int]],
           extras: dict[str, torch.Tensor], client: dict | bytes | None, keep_last: int = 0) -> None:
    """Rank 0, once every rank's shard file in `tmp` is durable (`files`: their sizes and CRC32s): write
    the extras, the client state and the manifest, rename `tmp` into place, replace `latest`, then
    delete all but the newest `keep_last` checkpoints (0: none)."""
    for name, entry in files.items():
        if not (tmp / name).is_file() or (tmp / name).stat().st_size != entry["bytes"]:
            raise ZerorunError(f"{tmp / name}: written by another rank but not visible here: checkpoint.dir "
                               "must be on a file system every node shares.")
    tag = manifest["tag"]
    files[EXTRAS] = as_entry(write_tensors(tmp / EXTRAS, extras))
    if isinstance(client, bytes):
        write_atomic(tmp / CLIENT_STATE, client)
        files[CLIENT_STATE] = as_entry(seal(tmp / CLIENT_STATE))
        manifest["client_state_file"] = CLIENT_STATE
    else:
        manifest["client_state"] = client
    manifest["files"] = files
    write_manifest(tmp / MANIFEST, manifest)  # with its checksum: an edit or damage is refused on load
    fsync_dir(tmp)
    crash_point("manifest", 0, tag)
    replace_dir(tmp, root / tag)
    write_atomic(root / LATEST, f"{tag}\n".encode())
    prune(root, keep_last)


def client_payload(client_state: dict | None) -> dict | bytes | None:
    """`client_state` as it is now: a copy of it when it is JSON (it goes into the manifest), else the
    bytes of client_state.pt (tensors and plain types), so that later changes by the script do not count."""
    if client_state is None or _jsonable(client_state):
        copied: dict = json.loads(json.dumps(client_state))
        return copied
    buffer = io.BytesIO()
    torch.save(client_state, buffer)
    return buffer.getvalue()


def extras_of(module: nn.Module, copy: bool = False) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters as host tensors to save (`copy`: never the live tensors themselves)."""
    return {name: t.detach().to("cpu", copy=copy).contiguous() for name, t in _extras(module).items()}


def rank_tensors(engine: Engine) -> dict[str, torch.Tensor]:
    """What this rank's file holds: its master pieces and its share of the optimizer's state, flat tensors in
    `flat_names` order, then the owned parameters' (the order a background save writes too: snapshot.py)."""
    flat = {**engine.store.saved_master(), **engine.update.flat_tensors()}
    kinds = [engine.store.home.kinds(g) for g in range(len(engine.store.group_numels))]
    return {**{name: flat[name] for name, _, _ in flat_names(kinds)}, **engine.update.owned_tensors()}


def describe_optimizer(engine: Engine) -> dict[str, Any]:
    """The manifest's optimizer section: hyper-parameters and the account of its state (a collective)."""
    groups = [{k: v for k, v in g.items() if k != "params" and _jsonable(v)} for g in engine.optimizer.param_groups]
    return {"param_groups": groups, **engine.update.describe(lambda value: gather_json(engine.comm, engine.device, value))}


def describe(engine: Engine, tag: str, rng: list[dict], optimizer: dict[str, Any]) -> dict[str, Any]:
    """The manifest, less its files: what the state is and where each parameter's pieces lie."""
    store, names = engine.store, first_names(engine.model)
    params = {}
    for unit in store.units:
        for index, (param, shape) in enumerate(zip(unit.params, unit.shapes)):
            pieces = []  # [saved rank, offset in its state, first element of the parameter, numel]
            for r in range(store.shard_world):
                piece = unit.layout.piece_of(index, r)
                if piece is not None:
                    pieces.append([r, unit.state_offset + piece.shard_start, piece.param_start, piece.numel])
            params[names[param]] = {"shape": list(shape), "dtype": _dtype_name(param.dtype), "group": unit.group,
                                    "pieces": pieces}
    extras = _extras(engine.model)
    return {
        "format": FORMAT, "version": VERSION, "zerorun": __version__, "saved_at": time.time(),
        "tag": tag, "global_step": engine.global_step, "skipped_steps": engine.skipped_steps,
        "world_size": engine.comm.world_size, "stage": engine.stage, "precision": engine.recipe.precision.dtype,
        "shards": store.shard_world, "group_numels": list(store.group_numels),
        "optimizer": optimizer,
        "loss_scaler": engine.scaler.state_dict(),
        "lr_schedulers": engine.lr_schedules.checkpoint_entries(engine.global_step),
        "params": params,
        "extras": {n: {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)} for n, t in extras.items()},
        "keys": list(engine.model.state_dict(keep_vars=True)),
        "aliases": _aliases(engine.model),
        "rng": rng,
    }


def crash_point(point: str, rank: int, tag: str) -> None:
    """Tests kill a worker in the middle of a save here (tests/launch/test_checkpoint_crash.py)."""
    if os.environ.get(CRASH_ENV) == f"{rank}:{point}:{tag}":
        os.kill(os.getpid(), signal.SIGKILL)


# -- load -----------------------------------------------------------------------------------------
def load(engine: Engine, directory: str | os.PathLike, tag: str | None = None) -> tuple[str, dict] | None:
    """Restore `engine` from `directory/tag` (default: `latest`): the tag and its client_state, or None
    when `tag` is None and the directory holds no checkpoint yet."""
    root = Path(directory)
    if tag is None and not (root / LATEST).is_file():
        return None
    ckpt = Checkpoint.open(root, tag)
    _verify_files(engine, ckpt)
    reads = _plan_reads(engine, ckpt)  # raises before anything is touched when the model differs
    resume_check.check(engine, ckpt.manifest, ckpt.path)  # ... or its optimizer type or precision
    for g, numel in enumerate(engine.store.group_numels):
        values = torch.zeros(numel, dtype=torch.float32)  # padding stays zero, as after initialisation
        for r in sorted(reads[g]):
            with ckpt.reading(shard_file(r)) as f:
                source = ckpt.slice_of(f, r, f"{MASTER}.{g}")
                for copy in reads[g][r]:
                    values[copy.dst:copy.dst + copy.numel] = source[copy.src:copy.src + copy.numel]
        engine.store.restore_master(g, values)
    with SavedOptimizerState(ckpt) as saved:
        engine.update.load(saved)
    _restore_extras(engine, ckpt)
    _restore_counters(engine, ckpt.manifest)
    engine.store.publish().wait()
    return ckpt.path.name.removeprefix(".old-"), ckpt.client_state() or {}


def _plan_reads(engine: Engine, ckpt: Checkpoint) -> list[dict[int, list]]:
    """Per group, per saved rank: the `Copy`s (partition.py) that fill this rank's state."""
    store, names, saved = engine.store, first_names(engine.model), ckpt.manifest["params"]
    _match_model(engine, ckpt)
    reads: list[dict[int, list]] = [defaultdict(list) for _ in store.group_numels]
    for unit in store.units:
        for piece in unit.layout.shard_pieces(store.shard_rank):  # the parts of parameters this rank owns
            name = names[unit.params[piece.index]]
            want = (piece.param_start, piece.param_start + piece.numel)
            copies = range_copies(want, unit.state_offset + piece.shard_start, saved[name]["pieces"])
            covered = sum(c.numel for c in copies)
            if covered != piece.numel:
                raise ZerorunError(f"{ckpt.path / MANIFEST}: the saved pieces of {name} cover {covered} of its "
                                   f"elements {want[0]}..{want[1]}, not all: the manifest is damaged.")
            for copy in copies:
                reads[unit.group][copy.source].append(copy)
    return reads


def _match_model(engine: Engine, ckpt: Checkpoint) -> None:
    """The checkpoint must describe this model: same parameter names, shapes and param groups."""
    names, m = first_names(engine.model), ckpt.manifest
    here = {names[p]: {"shape": list(shape), "group": u.group} for u in engine.store.units
            for p, shape in zip(u.params, u.shapes)}
    there = {n: {"shape": e["shape"], "group": e["group"]} for n, e in m["params"].items()}
    extras_here = {n: {"shape": list(t.shape)} for n, t in _extras(engine.model).items()}
    extras_there = {n: {"shape": e["shape"]} for n, e in m["extras"].items()}
    problems = _differences("parameter", here, there) + _differences("buffer/frozen parameter", extras_here,
                                                                     extras_there)
    if len(engine.optimizer.param_groups) != len(m["optimizer"]["param_groups"]):
        problems.append(f"{len(engine.optimizer.param_groups)} optimizer param groups here, "
                        f"{len(m['optimizer']['param_groups'])} in the checkpoint")
    if problems:
        raise ZerorunError(f"{ckpt.path / MANIFEST} does not describe this model (a checkpoint of another model?): "
                           + "; ".join(problems[:6]) + (" ..." if len(problems) > 6 else ""))


def _differences(what: str, here: dict[str, dict], there: dict[str, dict]) -> list[str]:
    out = [f"{what} {n} is missing from the checkpoint" for n in here if n not in there]
    out += [f"{what} {n} is in the checkpoint, not in the model" for n in there if n not in here]
    for n in sorted(here.keys() & there.keys()):
        out += [f"{what} {n}: {key} {here[n][key]} here, {there[n][key]} in the checkpoint"
                for key in here[n] if here[n][key] != there[n][key]]
    return out


def _verify_files(engine: Engine, ckpt: Checkpoint) -> None:
    """Every rank checks every file's size; each file's CRC32 is read by one rank; all ranks agree."""
    names = list(ckpt.manifest["files"])
    codes = torch.zeros(len(names), dtype=torch.int64, device=engine.device)
    rank, world = engine.comm.rank, engine.comm.world_size
    for i, name in enumerate(names):
        codes[i] = ckpt.file_problem(name, crc=i % world == rank)
    engine.comm.all_reduce(codes, op=torch.distributed.ReduceOp.MAX, async_op=False).wait()
    for name, code in zip(names, codes.tolist()):
        if code:
            raise ZerorunError(ckpt.problem_message(name, code))


def _restore_extras(engine: Engine, ckpt: Checkpoint) -> None:
    with ckpt.reading(EXTRAS) as f:
        with torch.no_grad():
            for name, tensor in _extras(engine.model).items():
                tensor.copy_(f.get_tensor(name))


def _restore_counters(engine: Engine, m: dict[str, Any]) -> None:
    """Step counts, hyper-parameters, loss scale, RNG states."""
    engine.global_step, engine.skipped_steps = m["global_step"], m["skipped_steps"]
    engine.micro_steps = engine.global_step * engine.grad_accum_steps  # saves happen at boundaries
    for group, saved in zip(engine.optimizer.param_groups, m["optimizer"]["param_groups"]):
        group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    engine.lr_schedules.restore(m.get("lr_schedulers", []))  # (a checkpoint of an older zerorun has none)
    if engine.scaler.dynamic and m["precision"] == "fp16":
        engine.scaler.load_state_dict(m["loss_scaler"])
    if m["world_size"] == engine.comm.world_size:
        _set_rng_state(m["rng"][engine.comm.rank])
    elif engine.comm.rank == 0:
        log.warning("RNG states not restored: saved on %d ranks, resumed on %d", m["world_size"],
                    engine.comm.world_size)


# -- helpers -------------------------------------------------------------------------------------------
def _extras(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers and frozen parameters of the state dict, once per tensor (they are whole on every rank)."""
    out, seen = {}, set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        out[name] = tensor.detach()
    return out


def _aliases(module: torch.nn.Module) -> dict[str, str]:
    """State dict keys naming a tensor that is saved under another name (tied weights) -> that name."""
    names = first_names(module)
    canonical: dict[int, str] = {}
    out = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        name = canonical.setdefault(id(tensor), names.get(tensor, key) if tensor.requires_grad else key)
        if name != key:
            out[key] = name
    return out


def _barrier(engine: Engine) -> None:
    engine.comm.all_reduce(torch.zeros(1, device=engine.device), async_op=False).wait()


def gather_rng(engine: Engine) -> list[dict[str, Any]]:
    """Every rank's RNG states, on every rank (a collective: all ranks call it)."""
    return gather_json(engine.comm, engine.device, _rng_state())


def gather_json(comm: Collectives, device: torch.device, value: Any) -> list[Any]:
    """Every rank's `value`, on every rank (JSON through two all-reduces; no pickling collectives)."""
    rank, world = comm.rank, comm.world_size
    data = json.dumps(value).encode()
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    sizes[rank] = len(data)
    comm.all_reduce(sizes, async_op=False).wait()
    table = torch.zeros(world, int(sizes.max()), dtype=torch.uint8, device=device)
    table[rank, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    comm.all_reduce(table, async_op=False).wait()
    rows = table.cpu()
    return [json.loads(bytes(rows[r, :n].tolist())) for r, n in enumerate(sizes.tolist())]


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()), "python": _listify(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
    state["numpy"] = [name, numpy.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(bytes(t.tolist())).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.tensor(list(base64.b64decode(s)), dtype=torch.uint8)


def _listify(value: Any) -> Any:
    return [_listify(v) for v in value] if isinstance(value, (tuple, list)) else value


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
