"""The mutations table stays true to the tree: each fix's text is there exactly once, and its tests exist."""

from __future__ import annotations

import pytest

from tests.mutations.run import ROOT
from tests.mutations.table import MUTATIONS, Mutation


def test_there_are_at_least_ten_and_their_names_are_unique() -> None:
    assert len(MUTATIONS) >= 10 and len({m.name for m in MUTATIONS}) == len(MUTATIONS)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_each_fix_is_in_the_tree_once_and_its_tests_exist(mutation: Mutation) -> None:
    assert (ROOT / mutation.path).read_text().count(mutation.fixed) == 1, (
        f"{mutation.path} no longer holds the fix of {mutation.name} exactly once: update tests/mutations/table.py")
    assert mutation.fixed != mutation.broken
    for where in mutation.caught_by:
        assert (ROOT / where.split("::")[0]).is_file(), where
