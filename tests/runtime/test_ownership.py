"""The owner way's placement: every parameter whole in one rank's piece, the work balanced, the same everywhere."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from zerorun.runtime.ownership import Balance, OwnershipPlan, matrix_cost, place_whole, size_cost
from zerorun.runtime.partition import whole_layout
from zerorun.runtime.units import cut_units


@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 9))
def test_in_one_unit_every_parameter_has_one_owner_and_no_rank_carries_more_than_the_mean_plus_one(costs, world):
    # cost = size: the piece's room never binds harder than greedy balance does
    loads = [0] * world
    owners = place_whole(costs, costs, world, loads)
    assert len(owners) == len(costs) and all(0 <= r < world for r in owners)
    assert [sum(c for c, r in zip(costs, owners) if r == rank) for rank in range(world)] == loads
    assert max(loads) <= sum(costs) / world + max(costs, default=0)
    assert owners == place_whole(list(costs), list(costs), world, [0] * world)  # deterministic


@given(st.lists(st.lists(st.integers(1, 5_000), min_size=1, max_size=8), min_size=1, max_size=12), st.integers(1, 5))
def test_over_many_units_the_costs_stay_balanced_within_the_largest_parameter(units, world):
    loads = [0] * world
    for numels in units:
        place_whole(numels, numels, world, loads)
    everything = [n for numels in units for n in numels]
    # a unit's room may send a parameter past the least-loaded rank, but never beyond an even share plus the largest
    assert max(loads) <= sum(everything) / world + 2 * max(everything)


@given(st.lists(st.integers(0, 3_000), max_size=12), st.integers(1, 5), st.sampled_from([1, 4, 16]))
def test_a_whole_layout_puts_each_parameter_in_its_owners_piece_and_pads_only_between_pieces(numels, world, align):
    owners = sorted(place_whole(numels, numels, world, [0] * world))
    layout = whole_layout(numels, owners, world, align)
    assert layout.padded_numel % (world * align) == 0 and layout.numel == sum(numels)
    for i, span in enumerate(layout.spans):
        if span.numel:
            assert layout.owner(i) == owners[i]
            assert layout.piece_of(i, owners[i]).numel == span.numel  # whole, on its owner
    covered = sorted([(s.offset, s.end) for s in layout.spans if s.numel] + layout.gaps())
    assert covered[0][0] == 0 and covered[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # spans and gaps tile the buffer, no overlap


def test_a_transformer_blocks_matrices_split_so_each_rank_holds_whole_ones_and_muon_balances_by_work() -> None:
    shapes = [torch.Size(s) for s in [(2304, 768), (768, 768), (3072, 768), (768, 3072), (768,), (768,)]]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    balance = Balance(matrix_cost, 2)
    (unit,) = cut_units(0, params, 10**8, 2, torch.float32, whole=balance)
    assert all(unit.layout.owner(i) is not None for i in range(len(params)))
    # the two largest matrices apart; the pieces as even as whole matrices allow
    owner = {tuple(s): unit.layout.owner(i) for i, s in enumerate(unit.shapes)}
    assert owner[(3072, 768)] != owner[(768, 3072)]
    pieces = [sum(p.numel() for i, p in enumerate(unit.params) if unit.layout.owner(i) == r) for r in range(2)]
    assert max(pieces) * 2 / sum(pieces) < 1.2
    # Newton-Schulz's work, not the size: a square matrix costs as much per element as a thin one of the same width
    assert matrix_cost(torch.Size((768, 3072))) == matrix_cost(torch.Size((3072, 768))) == 3072 * 768 * 768
    assert size_cost(torch.Size((4, 5))) == 20 and matrix_cost(torch.Size((7,))) == 7


def test_the_plan_reports_the_busiest_rank_over_the_mean() -> None:
    plan = OwnershipPlan.of([0, 1, 2], [64, 64, 64], 3)
    assert plan.owned(1) == [1] and plan.imbalance == 1.0
    lopsided = OwnershipPlan.of([0, 1, 1], [100, 1, 1], 2)
    assert abs(lopsided.imbalance - 200 / 102) < 1e-12
    assert OwnershipPlan.of([], [], 4).imbalance == 1.0
