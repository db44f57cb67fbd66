"""NVMe offload files: where a job keeps them, how a directory is checked, how they are found and removed.

    <nvme_path>/<job id>/rank-<r>/...*.bin         one rank's files: the optimizer's state, and under
                                                   params/ stage 3's parameter shard (offload_param: nvme)

The directory is the launch's job id (`owner`), never the run name: two jobs of one name on one
disk would otherwise truncate and overwrite each other's files (outside a launch: the run name).

Both sides use this module (it needs only the standard library, so the launcher does not pay
for importing torch):
- the runtime checks a path before a rank preallocates its files (`check_nvme_path`). Inside a
  launch the free space is checked for *every rank of the node together*: the ranks of one node
  share the disk, and each rank alone fitting said nothing about all of them. Files already at
  the node's own rank directories count as free, since the store truncates them;
- the launcher checks each node's paths before any worker starts (`inspect_path`, through the
  preflight), and removes the node's rank directories however the job ends (`remove_rank_dirs`,
  run by the node supervisor on that node: the workers may be dead by then).
When space is short, the message names the stale zerorun files found under the path.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zerorun.errors import ZerorunError
from zerorun.jobs import JOB_ID_ENV

ALIGN = 4096  # O_DIRECT block and buffer alignment
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
PARAMS = "params"  # the parameter store's subdirectory of a rank directory


def rank_dir(nvme_path: str | os.PathLike, owner: str | None, rank: int) -> Path:
    """`<nvme_path>/<owner>/rank-<r>/`: one directory per job and rank, so nothing sharing a disk collides."""
    return Path(nvme_path) / (owner or "zerorun") / f"rank-{rank}"


def owner(run: str | None) -> str | None:
    """Whose offload files a worker writes: its launch's job id, else (a script run by hand) the run name."""
    return os.environ.get(JOB_ID_ENV) or run


@dataclass(frozen=True)
class FoundFile:
    path: Path
    size: int


def offload_files(directory: Path, skip: str | None = None) -> list[FoundFile]:
    """zerorun's offload files (`*.bin`) anywhere under `directory`, but not under its `skip` subdirectory. Walked
    with os.walk, which passes over a directory that vanishes meanwhile (a sibling rank removing its temporary
    files): `Path.rglob` raised FileNotFoundError there."""
    found = []
    for root, dirs, files in os.walk(directory):
        if skip is not None and Path(root) == directory and skip in dirs:
            dirs.remove(skip)
        for name in files:
            if name.endswith(".bin"):
                path = Path(root) / name
                try:
                    found.append(FoundFile(path, path.stat().st_size))
                except OSError:
                    continue
    found.sort(key=lambda f: f.path)
    return found


def stale_files(nvme_path: str | os.PathLike, keep: Iterable[Path] = ()) -> list[FoundFile]:
    """Every zerorun offload file under `nvme_path` (any run, any rank) outside the directories in `keep`."""
    kept = {Path(k) for k in keep}
    return [f for rank in sorted(Path(nvme_path).glob("*/rank-*")) if rank not in kept for f in offload_files(rank)]


def describe(files: Sequence[FoundFile], limit: int = 4) -> str:
    """`DIR (N files, X GiB), ...`, grouped by rank directory, at most `limit` of them."""
    groups: dict[Path, list[FoundFile]] = {}
    for f in files:
        rank = next((p for p in f.path.parents if p.name.startswith("rank-")), f.path.parent)
        groups.setdefault(rank, []).append(f)
    shown = [f"{d} ({len(fs)} file{'s' if len(fs) != 1 else ''}, {size_text(sum(x.size for x in fs))})"
             for d, fs in list(groups.items())[:limit]]
    more = f" and {len(groups) - limit} more" if len(groups) > limit else ""
    return ", ".join(shown) + more


def remove_rank_dirs(directories: Iterable[str | os.PathLike]) -> list[FoundFile]:
    """Delete zerorun's offload files in these rank directories, then the directories (and their run
    directory) where nothing else is left; return what was deleted."""
    removed = []
    for directory in map(Path, directories):
        for f in offload_files(directory):
            try:
                f.path.unlink()
                removed.append(f)
            except OSError:
                continue
        subdirs = sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for empty in [*subdirs, directory, directory.parent]:
            try:
                empty.rmdir()  # only if nothing else lives there
            except OSError:
                pass
    return removed


# ---- checking a path -----------------------------------------------------------------------------

def inspect_path(path: str | os.PathLike | None, key: str) -> str:
    """What is wrong with `path` for NVMe offload files (empty: nothing): exists, a directory,
    writable, on a real disk, O_DIRECT works, not full."""
    if not path:
        return f"{key}: not set; NVMe offload needs a directory on a local disk."
    where = Path(path)
    if not where.exists():
        return (f"{key}: {path} does not exist; create it on a local NVMe disk (mkdir -p {path}) or point {key} "
                "at an existing directory.")
    if not where.is_dir():
        return f"{key}: {path} is not a directory."
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{key}: {path} is read-only for this process (uid {os.getuid()}); make it writable or choose another."
    fs = filesystem_type(where)
    if fs in MEMORY_FILESYSTEMS:
        return (f"{key}: {path} is on {fs}, which lives in RAM: offloading there saves no memory (and older kernels "
                "refuse O_DIRECT on it); use a directory on a real disk, ideally local NVMe.")
    return _probe_direct_io(where, key, fs)


def check_nvme_path(path: str | os.PathLike | None, key: str, need_bytes: int, store: Path | None = None) -> None:
    """Raise ZerorunError, naming `key` and `path`, unless `path` can hold the offload files.

    `need_bytes` is this rank's. Given `store` (this rank's directory for the files about to be
    created) inside a torchrun launch, the space is checked for every rank of this node together.
    """
    problem = inspect_path(path, key)
    if problem:
        raise ZerorunError(problem)
    assert path is not None
    stores = node_store_dirs(store) if store is not None else []

    def reusable() -> int:  # the files the store truncates: this node's, of this kind (parameters or not)
        return sum(f.size for d in stores for f in offload_files(d, skip=None if d.name == PARAMS else PARAMS))

    for _ in range(3):  # a sibling rank preallocating meanwhile moves bytes from free space into its files
        before, free = reusable(), shutil.disk_usage(path).free
        if before == reusable():
            break
    need = need_bytes * max(1, len(stores))
    if free + before >= need:
        return
    who = f"the {len(stores)} ranks of this node need {size_text(need)} ({size_text(need_bytes)} each)" if len(stores) > 1 \
        else f"this rank's offload files need {size_text(need)}"
    stale = stale_files(path, keep=[d if d.name != PARAMS else d.parent for d in stores])
    found = f"; stale zerorun offload files there: {describe(stale)} (remove them if no job uses them)" if stale else ""
    raise ZerorunError(f"{key}: {path} has {size_text(free)} free, but {who}{found}; free space there or choose a larger "
                       "disk.")


def node_store_dirs(store: Path) -> list[Path]:
    """`store` (`.../rank-<RANK>[/params]`) for every rank of this node, from torchrun's RANK,
    LOCAL_RANK and LOCAL_WORLD_SIZE (just `store` outside a launch)."""
    env = os.environ
    if not all(env.get(k, "").isdigit() for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        return [store]
    rank, local, size = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    parts = list(store.parts)
    assert f"rank-{rank}" in parts, f"check_nvme_path: {store} is not rank {rank}'s directory"
    at = len(parts) - 1 - parts[::-1].index(f"rank-{rank}")
    first = rank - local
    return [Path(*parts[:at], f"rank-{r}", *parts[at + 1:]) for r in range(first, first + size)]


def _probe_direct_io(where: Path, key: str, fs: str) -> str:
    """Write and read back one aligned block with O_DIRECT, as the store will; a problem or ''."""
    probe = where / f".zerorun-probe-{os.getpid()}-{threading.get_ident()}"
    block = mmap.mmap(-1, ALIGN)  # anonymous mappings are page-aligned
    fd = -1
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        os.pwrite(fd, block, 0)
        os.preadv(fd, [block], 0)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return f"{key}: {where} is read-only ({exc.strerror}); choose a writable directory."
        if exc.errno == errno.ENOSPC:
            stale = stale_files(where)
            found = f"; stale zerorun offload files there: {describe(stale)}" if stale else ""
            return f"{key}: {where} is full{found}; free space there or choose another disk."
        if exc.errno == errno.EINVAL:
            return (f"{key}: {where} ({fs}) refuses O_DIRECT I/O, which NVMe offload needs; use a directory on a "
                    "real disk (ext4, xfs on local NVMe), not tmpfs or a network file system.")
        return f"{key}: cannot do O_DIRECT I/O in {where} ({fs}): {exc.strerror}."
    finally:
        if fd >= 0:
            os.close(fd)
        probe.unlink(missing_ok=True)
        block.close()
    return ""


def filesystem_type(path: Path) -> str:
    """The type of the file system holding `path` (from /proc/self/mounts), or 'unknown'."""
    target = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].encode().decode("unicode_escape")  # \040 is a space
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        pass
    return kind


def size_text(nbytes: int) -> str:
    """A size in the unit that shows it: "0.00 GiB free ... need 0.00 GiB" said nothing on a small disk."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"
