"""The files of a sharded checkpoint: layout, atomic writes, reading with damage checks, consolidation.

    DIR/
      latest                      the tag of the newest complete checkpoint (replaced last of all)
      step-100/
        manifest.json             step, world size, stage, precision, hyper-parameters, loss scaler,
                                  per-rank RNG states, client_state, and per parameter: shape, dtype,
                                  param group and, for each saved rank, where its pieces lie
        rank-00000.safetensors    rank 0's flat fp32 state per param group g: master.<g> and its
        rank-00001.safetensors        optimizer's kinds (Adam: exp_avg.<g>, exp_avg_sq.<g>), and the
                                      whole state of the parameters it owns (owned.<name>.<key>;
                                      optim/owner_step.py)                       (stage 0: rank 0 only)
        model-extras.safetensors  buffers and frozen parameters, whole (written by rank 0)
        client_state.pt           only when client_state is not JSON (else it is in the manifest)

Tensors are safetensors: a plain header plus raw bytes, sliced lazily, never unpickled. The manifest
lists every file with its size and CRC32, and carries a checksum of itself; `Checkpoint.open`
refuses a manifest whose checksum or structure is wrong (`manifest.py`), and a file
whose size, CRC32 or tensor names, dtypes and shapes are not what the manifest says is an error
that names it. `latest` must hold one plain tag. Nothing here needs a process group:
`zerorun checkpoint info|consolidate|upgrade` use it as is, and `runtime/checkpoint/sharded.py` (the
engine's save and load) builds on it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from zerorun.errors import ZerorunError
from zerorun.runtime.checkpoint import safetensors_writer
from zerorun.runtime.checkpoint.manifest import (
    CLIENT_STATE,
    EXTRAS,
    FORMAT,
    LATEST,
    MANIFEST,
    SEALED_VERSIONS,
    UNSEALED_VERSION,
    check_integrity,
    rank_file_tensors,
    sealed,
    shard_file,
    validate,
)
from zerorun.runtime.checkpoint.safetensors_writer import Source, file_crc32

# safetensors' names of the dtypes a checkpoint holds (others are not compared)
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
MISSING, WRONG_SIZE, WRONG_CRC, WRONG_TENSORS = 1, 2, 3, 4  # file_problem's verdicts (0: as the manifest says)


def _is_plain_tag(tag: str) -> bool:
    return bool(tag) and not tag.startswith(".") and "/" not in tag and os.sep not in tag and tag != LATEST \
        and tag.isprintable()


def check_tag(tag: str) -> None:
    if not _is_plain_tag(tag):
        raise ZerorunError(f"checkpoint tag {tag!r}: use a plain name (no '/', not starting with '.', not 'latest').")


# -- reading (with damage checks) ------------------------------------------------------------------
class Checkpoint:
    """A checkpoint directory and its manifest, checked for damage before use."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path, self.manifest = path, manifest

    @classmethod
    def open(cls, root: Path, tag: str | None = None, unsealed: bool = False) -> Checkpoint:
        """The checkpoint `tag` (default: `latest`) with its manifest's checksum and structure checked;
        `unsealed` also accepts format 1, which has no checksum (only `upgrade` wants that)."""
        tag = tag or latest_tag(root)
        if tag is None:
            raise ZerorunError(f"{root}: no checkpoint here (no `{LATEST}` file); tags: {_tags_text(root)}.")
        path = _tag_dir(root, tag)
        if not path.is_dir():
            raise ZerorunError(f"{path}: no such checkpoint; tags in {root}: {_tags_text(root)}.")
        file = path / MANIFEST
        if not file.is_file():
            raise ZerorunError(f"{file}: missing; {path} is not a complete checkpoint.")
        try:
            manifest = json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ZerorunError(f"{file}: not valid JSON ({exc}); the manifest is damaged.") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ZerorunError(f"{file}: not a zerorun checkpoint manifest.")
        version = manifest.get("version")
        if version == UNSEALED_VERSION and not unsealed:
            raise ZerorunError(
                f"{file}: format version {version} (zerorun {manifest.get('zerorun', '?')}), whose manifest has no "
                "checksum, so an edited or damaged value in it (step, learning rate, file offsets) cannot be told "
                f"from a saved one. If you trust this checkpoint, `zerorun checkpoint upgrade {root} --tag {tag}` "
                "checks its structure and every file's CRC32, then adds the checksum.")
        if version not in (*SEALED_VERSIONS, UNSEALED_VERSION):
            raise ZerorunError(f"{file}: format version {version}; this zerorun reads "
                               f"{' and '.join(map(str, SEALED_VERSIONS))} (and upgrades {UNSEALED_VERSION}).")
        if version in SEALED_VERSIONS:
            check_integrity(file, manifest)
        validate(file, manifest)
        return cls(path, manifest)

    def file_problem(self, name: str, crc: bool, tensors: bool | None = None) -> int:
        """0 when `name` is as the manifest declares, else MISSING, WRONG_SIZE, WRONG_CRC (checked if `crc`)
        or WRONG_TENSORS (names, dtypes and shapes; checked if `tensors`, by default with the CRC32).
        Never raises: the ranks of a load agree on the verdicts before any of them reports one."""
        entry, file = self.manifest["files"][name], self.path / name
        if not file.is_file():
            return MISSING
        if file.stat().st_size != entry["bytes"]:
            return WRONG_SIZE
        if crc and file_crc32(file) != entry["crc32"]:
            return WRONG_CRC
        return WRONG_TENSORS if (crc if tensors is None else tensors) and self._tensor_problem(name) else 0

    def problem_message(self, name: str, code: int) -> str:
        file, entry = self.path / name, self.manifest["files"][name]
        if code == MISSING:
            return f"{file}: missing (the manifest lists it); the checkpoint is incomplete."
        if code == WRONG_SIZE:
            size = file.stat().st_size if file.is_file() else "a different number of"
            return f"{file}: {size} bytes, the manifest says {entry['bytes']}: truncated or overwritten."
        if code == WRONG_CRC:
            return f"{file}: CRC32 differs from the manifest's: the file is damaged."
        return f"{file}: {self._tensor_problem(name)}: the file does not hold what the manifest says."

    def verify(self, crc: bool = True) -> None:
        """Check every file in this process: sizes, tensor headers and (with `crc`) CRC32s."""
        for name in self.manifest["files"]:
            code = self.file_problem(name, crc=crc, tensors=True)
            if code:
                raise ZerorunError(self.problem_message(name, code))

    def _tensor_problem(self, name: str) -> str | None:
        """What differs between the tensors in file `name` and the manifest (None: nothing)."""
        m = self.manifest
        if name == CLIENT_STATE:
            return None  # torch.load(weights_only=True) reads it; its bytes are checked by size and CRC32
        if name == EXTRAS:
            expected = {n: (_SAFETENSORS_DTYPES.get(e["dtype"]), e["shape"]) for n, e in m["extras"].items()}
        else:
            rank = int(name.removeprefix("rank-").removesuffix(".safetensors"))
            expected = {key: (_SAFETENSORS_DTYPES.get(dtype), shape)
                        for key, (dtype, shape) in rank_file_tensors(m, rank).items()}
        try:
            with self.reading(name) as f:
                found = {key: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()) for key in f.keys()}
        except ZerorunError as exc:
            return str(exc).split(": ", 1)[-1]
        for key in sorted(expected.keys() | found.keys()):
            if key not in found:
                return f"no tensor {key}"
            if key not in expected:
                return f"a tensor {key} that the manifest does not list"
            (dtype, shape), (got_dtype, got_shape) = expected[key], found[key]
            if got_shape != shape or dtype not in (None, got_dtype):
                return f"tensor {key} is {got_dtype} {got_shape}, the manifest says {dtype or '?'} {shape}"
        return None

    @contextmanager
    def reading(self, name: str) -> Iterator[Any]:
        """Open safetensors file `name` lazily; an error reading it is an error naming the file."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(self.path / name, framework="pt") as f:
                yield f
        except (SafetensorError, OSError) as exc:
            raise ZerorunError(f"{self.path / name}: unreadable ({exc}); the file is damaged.") from None

    def slice_of(self, opened: Any, rank: int, name: str) -> Any:
        """A lazy slice of tensor `name` in saved rank `rank`'s file, checked against the manifest."""
        expected = self.manifest["group_numels"][int(name.split(".")[1])]
        if name not in opened.keys() or opened.get_slice(name).get_shape() != [expected]:
            raise ZerorunError(f"{self.path / shard_file(rank)}: tensor {name} is missing or not {expected} elements "
                               "as the manifest says.")
        return opened.get_slice(name)

    def client_state(self) -> dict | None:
        if "client_state_file" not in self.manifest:
            return self.manifest.get("client_state")
        file = self.path / self.manifest["client_state_file"]
        try:
            loaded: dict | None = torch.load(file, weights_only=True)
            return loaded
        except Exception as exc:  # noqa: BLE001 - unpickling errors have many types
            raise ZerorunError(f"{file}: unreadable ({type(exc).__name__}: {exc}).") from None


def latest_tag(root: Path) -> str | None:
    file = root / LATEST
    if not file.is_file():
        return None
    try:
        tag = file.read_text().strip()
    except UnicodeDecodeError:
        tag = None
    if tag is None or not _is_plain_tag(tag):
        shown = "bytes that are not text" if tag is None else repr(tag[:60]) if tag else "nothing"
        raise ZerorunError(f"{file}: holds {shown}, not the tag of a checkpoint here: the file is damaged. Write the "
                           f"tag to resume from into it (tags: {_tags_text(root)}), or remove it to start afresh.")
    if not _tag_dir(root, tag).is_dir():
        raise ZerorunError(f"{file}: points to {tag!r}, which is not in {root}; tags: {_tags_text(root)}.")
    return tag


def _tag_dir(root: Path, tag: str) -> Path:
    """`root/tag`, or its previous copy when a save of the same tag crashed between its two renames."""
    path, old = root / tag, root / f".old-{tag}"
    return old if not path.exists() and old.is_dir() else path


def tags(root: Path) -> list[str]:
    """Complete checkpoints in `root`, oldest first."""
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()] \
        if root.is_dir() else []
    return [p.name for p in sorted(found, key=lambda p: (p / MANIFEST).stat().st_mtime)]


def _tags_text(root: Path) -> str:
    return ", ".join(tags(root)) or "none"


# -- consolidation and info (the CLI) --------------------------------------------------------------
# -- writing (temporary names, fsync, rename) ------------------------------------------------------
def write_tensors(path: Path, tensors: dict[str, torch.Tensor] | list[Source],
                  pace: Callable[[], None] | None = None) -> tuple[int, int]:
    """A safetensors file of `tensors` (or streamed `Source`s), fsynced; its size and CRC32. A full disk is
    a ZerorunError naming the path, the errno and what is kept, not a traceback (`write_atomic` too)."""
    sources = [Source.of(n, t) for n, t in tensors.items()] if isinstance(tensors, dict) else tensors
    try:
        return safetensors_writer.write(path, sources, {"format": FORMAT}, pace)
    except Exception as exc:
        if not _disk_full(exc):
            raise
        path.unlink(missing_ok=True)
        raise ZerorunError(disk_full(path, exc)) from None


def os_error(exc: OSError) -> str:
    """An OSError as `strerror (ENAME, errno N)`, the way checkpoint errors name it."""
    if exc.errno is None:
        return str(exc)
    return f"{exc.strerror} ({errno.errorcode.get(exc.errno, '?')}, errno {exc.errno})"


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "os error 28" in str(exc) or "No space left" in str(exc) or "os error 122" in str(exc)


def disk_full(path: Path, exc: BaseException | None = None) -> str:
    """What a save that found its disk full says: where, how much is free, which checkpoint is kept."""
    from zerorun.offload_files import size_text

    root = path.parent.parent if path.parent.name.startswith(".tmp-") else path.parent
    try:
        free = f"{size_text(shutil.disk_usage(root).free)} free"
    except OSError:
        free = "full"
    if isinstance(exc, OSError) and exc.errno is not None:
        free = f"{os_error(exc)}; {free}"
    kept = latest_tag(root)
    there = tags(root)
    older = f"; tags there: {', '.join(there)}" if there else ""
    kept_text = f"the last complete checkpoint, {kept}, is kept" if kept else "no earlier checkpoint is there"
    return (f"{path}: no space left on the checkpoint disk ({free}); this save is abandoned and {kept_text}{older}. "
            "Free space in checkpoint.dir (remove tags you no longer need) or point it at a larger disk.")


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """The manifest with its checksum (`manifest.sealed`), written atomically."""
    write_atomic(path, json.dumps(sealed(manifest), indent=1).encode())


def seal(path: Path) -> tuple[int, int]:
    """fsync `path`; its size and CRC32 (read back from the page cache)."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return path.stat().st_size, file_crc32(path)


def as_entry(sealed: tuple[int, int]) -> dict[str, int]:
    return {"bytes": sealed[0], "crc32": sealed[1]}


def write_atomic(path: Path, data: bytes) -> None:
    """Temporary name, fsync, rename, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if not _disk_full(exc):
            raise
        tmp.unlink(missing_ok=True)
        raise ZerorunError(disk_full(path)) from None
    os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same tag saved again) is moved aside first."""
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def clean_crashed_saves(root: Path) -> None:
    """Remove `.tmp-*` directories; put back a `.old-<tag>` whose replacement never arrived."""
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in root.glob(".old-*"):
        final = root / old.name.removeprefix(".old-")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(old, final)


def prune(root: Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints in `root`, never the one `latest` names
    (`keep` 0: delete nothing); the tags deleted."""
    if keep <= 0:
        return []
    latest = latest_tag(root)
    old = [tag for tag in tags(root)[:-keep] if tag != latest]
    for tag in old:
        shutil.rmtree(root / tag, ignore_errors=True)
    return old


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def numel_of(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
