"""Shard arithmetic, without a process group: every element is owned exactly once, in order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zerorun.runtime.partition import bucket_params, flat_layout, intersect, range_copies, round_up

numels = st.lists(st.integers(min_value=0, max_value=5000), min_size=0, max_size=12)
worlds = st.integers(min_value=1, max_value=9)
aligns = st.sampled_from([1, 2, 16, 32])


@given(numels, worlds, aligns)
def test_layout_pads_to_equal_aligned_shards(sizes: list[int], world: int, align: int) -> None:
    layout = flat_layout(sizes, world, align)
    assert layout.numel == sum(sizes)
    assert layout.padded_numel % (world * align) == 0
    assert layout.padded_numel >= max(layout.numel, world * align)
    assert layout.padding < world * align or layout.numel == 0
    assert layout.shard_numel % align == 0


@given(numels, worlds, aligns)
def test_shard_pieces_cover_every_parameter_element_exactly_once(sizes: list[int], world: int, align: int) -> None:
    layout = flat_layout(sizes, world, align)
    covered = [[0] * n for n in sizes]
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_numel
        for piece in layout.shard_pieces(rank):
            span = layout.spans[piece.index]
            assert 0 <= piece.shard_start and piece.shard_start + piece.numel <= layout.shard_numel
            # the piece sits at the same flat position seen from the parameter and from the shard
            assert span.offset + piece.param_start == lo + piece.shard_start
            for i in range(piece.param_start, piece.param_start + piece.numel):
                covered[piece.index][i] += 1
    assert all(count == 1 for param in covered for count in param)


@given(numels, worlds, aligns)
def test_piece_of_is_the_ranks_part_of_each_parameter(sizes: list[int], world: int, align: int) -> None:
    layout = flat_layout(sizes, world, align)
    for rank in range(world):
        lo, hi = layout.shard_range(rank)
        for index, span in enumerate(layout.spans):
            piece = layout.piece_of(index, rank)
            inside = [i for i in range(span.offset, span.end) if lo <= i < hi]
            if not inside:
                assert piece is None
                continue
            assert (piece.param_start, piece.numel) == (inside[0] - span.offset, len(inside))
            assert piece.shard_start == inside[0] - lo


ranges = st.tuples(st.integers(0, 50), st.integers(0, 50)).map(sorted).map(tuple)


@given(ranges, ranges)
def test_intersect_is_the_common_part_of_two_ranges(a: tuple[int, int], b: tuple[int, int]) -> None:
    common = set(range(*a)) & set(range(*b))
    both = intersect(a, b)
    assert (set(range(*both)) if both else set()) == common
    assert both is None or both[0] < both[1]


@given(numels.filter(any), worlds, worlds, aligns)
def test_range_copies_move_every_owned_element_from_wherever_it_was_saved(sizes: list[int], saved_world: int,
                                                                         world: int, align: int) -> None:
    """A checkpoint saved on `saved_world` ranks, loaded on `world`: simulate with element ids."""
    saved, now = flat_layout(sizes, saved_world, align), flat_layout(sizes, world, 1)
    states = [[None] * saved.shard_numel for _ in range(saved_world)]  # each saved rank's flat state
    held: list[list[tuple[int, int, int, int]]] = [[] for _ in sizes]
    for r in range(saved_world):
        for p in saved.shard_pieces(r):
            for i in range(p.numel):
                states[r][p.shard_start + i] = (p.index, p.param_start + i)
            held[p.index].append((r, p.shard_start, p.param_start, p.numel))
    for rank in range(world):
        loaded = [None] * now.shard_numel
        for p in now.shard_pieces(rank):
            copies = range_copies((p.param_start, p.param_start + p.numel), p.shard_start, held[p.index])
            assert sum(c.numel for c in copies) == p.numel
            for c in copies:
                for i in range(c.numel):
                    assert loaded[c.dst + i] is None, "an element written twice"
                    loaded[c.dst + i] = states[c.source][c.src + i]
            assert loaded[p.shard_start:p.shard_start + p.numel] == [(p.index, p.param_start + i) for i in range(p.numel)]


def test_uneven_example_three_ranks() -> None:
    layout = flat_layout([5, 3, 7], world_size=3, align=2)  # 15 elements -> 18 padded, 6 per rank
    assert layout.shard_numel == 6 and layout.padding == 3
    assert [(p.index, p.param_start, p.shard_start, p.numel) for p in layout.shard_pieces(1)] == [
        (1, 1, 0, 2), (2, 0, 2, 4)]
    assert layout.piece_of(0, 1) is None and layout.piece_of(2, 2).numel == 3


def test_empty_unit_still_gives_every_rank_a_shard() -> None:
    layout = flat_layout([], world_size=4, align=16)
    assert layout.shard_numel == 16 and layout.shard_pieces(3) == []


@given(numels.filter(bool), st.integers(min_value=1, max_value=9000))
def test_buckets_keep_order_never_split_and_respect_size(sizes: list[int], bucket: int) -> None:
    buckets = bucket_params(sizes, bucket)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))
    for b in buckets:
        assert b, "no empty bucket"
        assert len(b) == 1 or sum(sizes[i] for i in b) <= bucket


def test_round_up() -> None:
    assert [round_up(v, 8) for v in (0, 1, 8, 9)] == [0, 8, 8, 16]
