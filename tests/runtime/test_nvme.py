"""zerorun.runtime.offload.nvme: the tile store keeps data bit-exact through whole-tensor writes/reads and the
pipelined tile pass (any span alignment, tiles smaller than a block, write-back subsets), on every
I/O backend; check_nvme_path refuses unusable directories with the key and the reason."""

from __future__ import annotations

import errno
import gc
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun import ops
from zerorun.errors import ZerorunError
from zerorun.runtime.offload import nvme
from zerorun.runtime.offload.aio import ALIGN, AioSettings
from zerorun.runtime.offload.nvme import NvmeFiles, aligned_empty, check_nvme_path, plan_tiles

KEY = "zero.offload_optimizer.nvme_path"


@pytest.fixture(scope="module")
def aio_kernel() -> None:
    line = ops.build(["aio"])["aio"]
    assert line.startswith("loaded"), line


@pytest.fixture(params=["libaio", "threads", "python"])
def aio(request: pytest.FixtureRequest, aio_kernel: None) -> AioSettings:
    """Small blocks and a shallow queue, so that a tile is many requests and the queue fills."""
    return AioSettings(block_size=8192, queue_depth=3, threads=2, backend=request.param)


def _store(root: Path, aio: AioSettings, numel: int, tile_numel: int, dtype: torch.dtype = torch.float32,
           names: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq")) -> NvmeFiles:
    store = NvmeFiles(root, {name: numel for name in names}, tile_numel=tile_numel, aio=aio, dtype=dtype)
    assert store.backend == aio.backend
    return store


def _random_spans(rng: random.Random, numel: int, count: int) -> list[tuple[int, int]]:
    """Increasing, disjoint spans with odd starts, lengths and gaps (some adjacent, some empty)."""
    cuts = sorted(rng.sample(range(numel + 1), 2 * count))
    spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2)]
    return [(lo, hi if rng.random() < 0.7 else lo) for lo, hi in spans] + [(cuts[-1], numel)]


# ---- aligned buffers ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64])
def test_aligned_empty_starts_on_a_4096_byte_boundary(dtype: torch.dtype) -> None:
    for numel in (0, 1, 1023, 4097, 100_000):
        buffer = aligned_empty(numel, dtype, pin=True)  # pin=True must not raise on a CPU build of torch
        assert buffer.data_ptr() % ALIGN == 0 and buffer.numel() == numel and buffer.dtype == dtype
        assert buffer.is_pinned() == (torch.cuda.is_available() and numel > 0) or not torch.cuda.is_available()


# ---- tile planning (pure) ------------------------------------------------------------------------

@given(st.lists(st.integers(0, 3000), min_size=0, max_size=12), st.integers(1, 2500), st.sampled_from([2, 4]))
@settings(max_examples=300, deadline=None)
def test_every_block_of_a_tile_pass_is_written_once_and_after_its_last_update(cuts: list[int], tile_numel: int,
                                                                              itemsize: int) -> None:
    cuts = sorted(cuts)[:len(cuts) // 2 * 2]
    spans = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts), 2)]
    tiles = plan_tiles(spans, tile_numel, itemsize)
    assert [(t.start, t.end) for t in tiles] == [(lo, min(hi, lo + tile_numel)) for lo, hi in spans
                                                 for lo in range(lo, hi, tile_numel)]
    written: dict[int, int] = {}  # block -> the tile that writes it
    for k, tile in enumerate(tiles):
        assert tile.lo % ALIGN == 0 and tile.hi % ALIGN == 0 and tile.lo <= tile.start * itemsize
        assert tile.end * itemsize <= tile.hi and tile.hi - tile.lo <= -(-tile_numel * itemsize // ALIGN) * ALIGN + ALIGN
        for block in range(tile.lo, tile.write_hi, ALIGN):
            assert block not in written
            written[block] = k
    for k, tile in enumerate(tiles):  # a block holding elements of tile k is written by k or a later tile
        for block in range(tile.lo, tile.hi, ALIGN):
            assert written[block] >= k
            assert all(tiles[j].lo <= block < tiles[j].hi for j in range(k, written[block] + 1))


def test_spans_must_be_increasing_and_disjoint() -> None:
    with pytest.raises(ValueError, match="increasing and disjoint"):
        plan_tiles([(10, 20), (15, 30)], 100, 4)
    with pytest.raises(ValueError, match="increasing and disjoint"):
        plan_tiles([(10, 20), (0, 5)], 100, 4)


# ---- whole tensors -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_data_reads_back_bit_exact_at_any_offset(aio: AioSettings, direct_io_dir: Path,
                                                         dtype: torch.dtype) -> None:
    numel = 50_021
    store = _store(direct_io_dir / "store", aio, numel, tile_numel=3_001, dtype=dtype, names=("a",))
    try:
        full = torch.randn(numel).to(dtype)
        direct = aligned_empty(numel, dtype)
        store.write("a", direct.copy_(full.flip(0)))  # the direct path: aligned memory at an aligned offset
        store.write("a", full[1:], start=1)  # unaligned memory and file offset, longer than the bounce buffer
        store.write("a", full[:1])
        aligned = aligned_empty(numel, dtype)
        store.read("a", aligned)  # the direct path: aligned memory at an aligned offset
        assert torch.equal(aligned, full)
        rng = random.Random(0)
        for _ in range(20):
            start = rng.randrange(numel)
            piece = torch.randn(rng.randrange(numel - start + 1)).to(dtype)
            store.write("a", piece, start=start)  # read-modify-write of the edge blocks keeps the neighbours
            full[start:start + piece.numel()] = piece
            out = torch.empty(rng.randrange(numel - start + 1), dtype=dtype)
            store.read("a", out, start=start)
            assert torch.equal(out, full[start:start + out.numel()])
        strided = torch.empty(2 * 1000, dtype=dtype)[::2]
        store.read("a", strided, start=7)
        assert torch.equal(strided, full[7:1007])
        store.read("a", aligned)
        assert torch.equal(aligned, full)
    finally:
        store.close()


def test_a_second_store_reopens_nothing_stale(aio: AioSettings, direct_io_dir: Path) -> None:
    """Files are created empty (truncated) and removed on close, with their directory."""
    root = direct_io_dir / "rank-0"
    for _ in range(2):
        store = _store(root, aio, 10_000, tile_numel=1_000, names=("a",))
        out = torch.ones(10_000)
        store.read("a", out)
        assert torch.equal(out, torch.zeros(10_000))
        store.write("a", torch.randn(10_000))
        assert sorted(p.name for p in root.iterdir()) == ["a.bin"]
        assert (root / "a.bin").stat().st_size == store.disk_bytes() == 40_960
        store.close()
        assert not root.exists()


def test_a_store_at_the_path_of_one_not_yet_collected_keeps_its_own_file(direct_io_dir: Path) -> None:
    """Engine after engine at one path (a test, a restart in one process): the earlier store, not yet collected,
    keeps its data, and its cleanup removes its own file only, never the later store's (one truncated and shared
    file lost a checkpoint test's files to the previous engine's garbage collection)."""
    aio = AioSettings(backend="python")
    root = direct_io_dir / "rank-0"
    earlier = _store(root, aio, 1000, tile_numel=100, names=("a",))
    earlier.write("a", torch.ones(1000))
    later = _store(root, aio, 1000, tile_numel=100, names=("a",))
    later.write("a", torch.full((1000,), 2.0))
    seen = torch.zeros(1000)
    earlier.read("a", seen)
    assert torch.equal(seen, torch.ones(1000))
    del earlier
    gc.collect()
    assert (root / "a.bin").is_file()
    later.read("a", seen)
    assert torch.equal(seen, torch.full((1000,), 2.0))
    later.close()
    assert not root.exists()


def test_dropping_the_last_reference_removes_the_files(aio: AioSettings, direct_io_dir: Path) -> None:
    root = direct_io_dir / "dropped"
    store = _store(root, aio, 1000, tile_numel=100)
    assert len(list(root.iterdir())) == 3
    del store
    gc.collect()
    assert not root.exists()


def test_wrong_dtype_name_or_range_is_refused(aio: AioSettings, direct_io_dir: Path) -> None:
    store = _store(direct_io_dir / "store", aio, 100, tile_numel=10, names=("a",))
    try:
        with pytest.raises(ValueError, match="holds torch.float32"):
            store.write("a", torch.zeros(10, dtype=torch.bfloat16))
        with pytest.raises(KeyError, match="no file 'b'"):
            store.read("b", torch.zeros(10))
        with pytest.raises(IndexError, match=r"\[95, 105\) are outside a"):
            store.write("a", torch.zeros(10), start=95)
    finally:
        store.close()


# ---- the tile pass -----------------------------------------------------------------------------

def _adam_like(order: list[tuple[int, int]]):
    """An update that reads every name and depends on the call order (a running counter)."""
    def update(start: int, end: int, views: dict[str, torch.Tensor]) -> None:
        order.append((start, end))
        k = float(len(order))
        views["exp_avg"].mul_(0.5).add_(views["master"], alpha=k)
        views["master"].add_(views["exp_avg_sq"]).add_(k)
    return update


def _reference(states: dict[str, torch.Tensor], tiles: list[tuple[int, int]], write_back: list[str]) -> None:
    """The same pass, one tile at a time in memory: what the files must hold afterwards."""
    update = _adam_like([])
    for start, end in tiles:
        views = {name: t[start:end].clone() for name, t in states.items()}
        update(start, end, views)
        for name in write_back:
            states[name][start:end] = views[name]


@pytest.mark.parametrize("tile_numel", [100, 1_500, 4_096])  # below a block, odd, exactly 4 blocks
def test_pipelined_pass_equals_the_one_tile_at_a_time_reference(aio: AioSettings, direct_io_dir: Path,
                                                                tile_numel: int) -> None:
    numel, rng = 20_011, random.Random(tile_numel)
    store = _store(direct_io_dir / "store", aio, numel, tile_numel)
    try:
        states = {name: torch.randn(numel) for name in store.numels}
        for name, values in states.items():
            store.write(name, values)
        for write_back in (["master", "exp_avg"], ["exp_avg_sq", "master", "exp_avg"], []):
            spans = _random_spans(rng, numel, 6)
            order: list[tuple[int, int]] = []
            store.for_each_tile(list(store.numels), spans, _adam_like(order), write_back=write_back)
            assert order == [(lo, min(hi, lo + tile_numel)) for lo, hi in spans for lo in range(lo, hi, tile_numel)]
            _reference(states, order, write_back)
            for name, expected in states.items():
                got = torch.empty(numel)
                store.read(name, got)
                assert torch.equal(got, expected), (name, write_back, (got != expected).nonzero()[:5].tolist())
    finally:
        store.close()


def test_adjacent_spans_of_the_optimizer_share_blocks_without_losing_updates(aio: AioSettings,
                                                                           direct_io_dir: Path) -> None:
    """The lead's shape: pieces back to back, each cut into tiles, views passed to a kernel."""
    pieces = [1, 1023, 7, 4096, 2049, 3, 10_000]
    numel = sum(pieces)
    store = _store(direct_io_dir / "store", aio, numel, tile_numel=1_000, names=("master",))
    try:
        store.write("master", torch.zeros(numel))
        spans, start = [], 0
        for n in pieces:
            spans += [(lo, min(start + n, lo + 1_000)) for lo in range(start, start + n, 1_000)]
            start += n
        for _ in range(3):
            store.for_each_tile(["master"], spans, lambda lo, hi, v: v["master"].add_(1), write_back=["master"])
        out = torch.empty(numel)
        store.read("master", out)
        assert torch.equal(out, torch.full((numel,), 3.0))
    finally:
        store.close()


def test_views_are_flat_in_the_store_dtype_and_stats_count_the_traffic(aio: AioSettings, direct_io_dir: Path) -> None:
    store = _store(direct_io_dir / "store", aio, 10_000, tile_numel=2_048, dtype=torch.bfloat16, names=("p", "q"))
    try:
        seen = []
        store.for_each_tile(["p", "q"], [(0, 10_000)], lambda lo, hi, v: seen.append(
            {k: (t.dtype, t.shape, t.is_contiguous()) for k, t in v.items()}), write_back=["p"])
        assert seen == [{k: (torch.bfloat16, (n,), True) for k in "pq"} for n in (2048,) * 4 + (1808,)]
        stats = store.stats.as_dict()
        assert stats["bytes_read"] == 2 * 20_480 and stats["bytes_written"] == 20_480
        assert stats["read_s"] > 0 and stats["write_s"] > 0 and stats["wait_s"] > 0
        assert store.held_bytes() == 2 * 3 * (4096 + 4096)  # a ring of 3 slots per name, no bounce yet
        assert store.disk_bytes() == 2 * 20_480
    finally:
        store.close()


def test_an_exception_in_fn_leaves_nothing_in_flight_and_the_store_usable(aio: AioSettings,
                                                                        direct_io_dir: Path) -> None:
    store = _store(direct_io_dir / "store", aio, 10_000, tile_numel=1_000, names=("a",))
    try:
        store.write("a", torch.arange(10_000, dtype=torch.float32))

        def fail_at_the_fourth(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
            if lo == 3_000:
                raise RuntimeError("boom")
            views["a"].neg_()
        with pytest.raises(RuntimeError, match="boom"):
            store.for_each_tile(["a"], [(0, 10_000)], fail_at_the_fourth, write_back=["a"])
        store.for_each_tile(["a"], [(0, 3_000)], lambda lo, hi, v: v["a"].neg_(), write_back=["a"])
        out = torch.empty(10_000)
        store.read("a", out)
        assert torch.equal(out, torch.arange(10_000, dtype=torch.float32))
    finally:
        store.close()


def test_tile_pass_refuses_bad_names_and_spans(aio: AioSettings, direct_io_dir: Path) -> None:
    store = _store(direct_io_dir / "store", aio, 100, tile_numel=10, names=("a", "b"))
    try:
        with pytest.raises(KeyError, match="write_back a subset of names"):
            store.for_each_tile(["a"], [(0, 10)], lambda *_: None, write_back=["b"])
        with pytest.raises(IndexError, match="past the end of a"):
            store.for_each_tile(["a"], [(90, 101)], lambda *_: None, write_back=[])
        with pytest.raises(ValueError, match="increasing and disjoint"):
            store.for_each_tile(["a"], [(50, 60), (0, 10)], lambda *_: None, write_back=["a"])
    finally:
        store.close()


# ---- check_nvme_path -----------------------------------------------------------------------------

def test_a_usable_directory_passes(direct_io_dir: Path) -> None:
    check_nvme_path(str(direct_io_dir), KEY, need_bytes=2**20)
    assert list(direct_io_dir.iterdir()) == []  # the probe file is gone


def test_missing_path_or_file_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ZerorunError, match=f"{KEY}: {tmp_path}/nope does not exist; create it"):
        check_nvme_path(str(tmp_path / "nope"), KEY, 1)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ZerorunError, match=f"{KEY}: {tmp_path}/file is not a directory"):
        check_nvme_path(str(tmp_path / "file"), KEY, 1)
    with pytest.raises(ZerorunError, match=f"{KEY}: not set"):
        check_nvme_path(None, KEY, 1)


def test_not_enough_free_space_says_how_much(direct_io_dir: Path) -> None:
    free = shutil.disk_usage(direct_io_dir).free
    with pytest.raises(ZerorunError, match=rf"{KEY}: {direct_io_dir} has [\d.]+ (GiB|MiB|KiB) free, but this rank's offload "
                                           r"files need [\d.]+ (GiB|MiB|KiB)"):
        check_nvme_path(str(direct_io_dir), KEY, need_bytes=free + 2**40)


def test_read_only_directory_is_refused(direct_io_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As another user would see it: os.access says no (root's own check ignores mode bits)."""
    real_access = os.access
    monkeypatch.setattr(nvme.os, "access", lambda p, mode: False if Path(p) == direct_io_dir else real_access(p, mode))
    with pytest.raises(ZerorunError, match=f"{KEY}: {direct_io_dir} is read-only for this process"):
        check_nvme_path(str(direct_io_dir), KEY, 1)


def test_read_only_mount_is_refused(direct_io_dir: Path) -> None:
    """A real read-only bind mount (needs root and mount permission)."""
    (direct_io_dir / "rw").mkdir()
    ro = direct_io_dir / "ro"
    ro.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(direct_io_dir / "rw"), str(ro)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True)
        assert remount.returncode == 0, remount.stderr
        with pytest.raises(ZerorunError, match=f"{KEY}: {ro} is read-only"):
            check_nvme_path(str(ro), KEY, 1)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_memory_file_systems_are_refused_with_a_suggestion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = Path("/dev/shm")
    if not (shm.is_dir() and nvme.filesystem_type(shm) == "tmpfs" and os.access(shm, os.W_OK)):
        monkeypatch.setattr(nvme, "filesystem_type", lambda path: "tmpfs")
        shm = tmp_path
    with pytest.raises(ZerorunError, match=f"{KEY}: {shm} is on tmpfs, which lives in RAM.*use a directory on a "
                                           "real disk"):
        check_nvme_path(str(shm), KEY, 1)


def test_a_file_system_refusing_o_direct_is_named(direct_io_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)
    monkeypatch.setattr(nvme.os, "open", no_direct)
    with pytest.raises(ZerorunError, match=f"{KEY}: {direct_io_dir} .* refuses O_DIRECT I/O.*real disk"):
        check_nvme_path(str(direct_io_dir), KEY, 1)


def test_sizes_in_messages_use_a_unit_that_shows_them() -> None:
    from zerorun.offload_files import size_text

    assert [size_text(n) for n in (512, 3 * 2**10, 5 * 2**20 + 2**19, 3 * 2**30)] == \
        ["512 bytes", "3.00 KiB", "5.50 MiB", "3.00 GiB"]
