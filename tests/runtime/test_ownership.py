"""The owner way's plan: every parameter owned once, balanced within one parameter, the same everywhere."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zerorun.runtime.optim.ownership import plan_ownership


@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 9))
def test_every_parameter_has_one_owner_and_no_rank_carries_more_than_the_mean_plus_one_parameter(costs, world):
    plan = plan_ownership(costs, world)
    assert sorted(i for r in range(world) for i in plan.owned(r)) == list(range(len(costs)))
    assert [sum(costs[i] for i in plan.owned(r)) for r in range(world)] == list(plan.loads)
    mean = sum(costs) / world
    assert max(plan.loads) <= mean + max(costs, default=0)
    assert plan == plan_ownership(list(costs), world)  # deterministic: every rank computes the same plan


def test_equal_matrices_spread_one_per_rank_and_the_imbalance_says_how_uneven() -> None:
    plan = plan_ownership([64, 64, 64], 3)
    assert sorted(plan.owner) == [0, 1, 2] and plan.imbalance == 1.0
    lopsided = plan_ownership([100, 1, 1], 2)
    assert lopsided.owned(0) == [0] and lopsided.owned(1) == [1, 2]
    assert abs(lopsided.imbalance - 200 / 102) < 1e-12
    assert plan_ownership([], 4).imbalance == 1.0
