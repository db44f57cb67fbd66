"""Shard arithmetic, without a process group: every element is owned exactly once, in order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zerorun.runtime.partition import bucket_params, flat_layout, round_up

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


@given(numels, worlds)
def test_owners_are_the_ranks_with_pieces(sizes: list[int], world: int) -> None:
    layout = flat_layout(sizes, world, 1)
    for index in range(len(sizes)):
        holders = [r for r in range(world) if any(p.index == index for p in layout.shard_pieces(r))]
        assert layout.owners(index) == holders


def test_uneven_example_three_ranks() -> None:
    layout = flat_layout([5, 3, 7], world_size=3, align=2)  # 15 elements -> 18 padded, 6 per rank
    assert layout.shard_numel == 6 and layout.padding == 3
    assert [(p.index, p.param_start, p.shard_start, p.numel) for p in layout.shard_pieces(1)] == [
        (1, 1, 0, 2), (2, 0, 2, 4)]
    assert layout.owners(2) == [1, 2]


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
