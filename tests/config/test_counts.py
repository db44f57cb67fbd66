"""Counts as people write them (`7B`, `1.5e9`, `350M`), read by one parser wherever a count is asked for."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zerorun import config
from zerorun.cli import app
from zerorun.config.counts import parse_count
from zerorun.errors import ConfigError


@pytest.mark.parametrize(("text", "value"), [
    ("7B", 7 * 10**9), ("7b", 7 * 10**9), ("1.5e9", 1_500_000_000), ("350M", 350 * 10**6), ("12K", 12_000),
    ("1.5G", 1_500_000_000), ("2T", 2 * 10**12), ("7_000_000_000", 7 * 10**9), ("1,000", 1000),
    ("7000000000123", 7_000_000_000_123), ("2.5K", 2500), ("100", 100), (" 8 M ", 8_000_000),
])
def test_a_count_takes_suffixes_exponents_and_separators(text: str, value: int) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize(("text", "why"), [
    ("7X", "is not a count"), ("1.5", "not a whole number"), ("0", "at least 1"), ("-3", "is not a count"),
    ("", "is not a count"), ("1e-3", "not a whole number"),
])
def test_what_is_not_a_count_is_refused_with_the_forms_a_count_takes(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        parse_count(text)
    assert "7B, 1.5e9, 350M" in str(info.value)


def test_estimate_takes_7b_as_it_takes_7e9() -> None:
    runs = [CliRunner().invoke(app, ["estimate", "--params", size, "--largest-layer", layer, "--json"])
            for size, layer in (("7B", "200M"), ("7e9", "2e8"), ("7000000000", "200000000"))]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    shapes = [json.loads(r.stdout)["model"] for r in runs]
    assert shapes[0] == shapes[1] == shapes[2] == {"params": 7 * 10**9, "largest_unit": 2 * 10**8, "root": 0,
                                                   "persistent": 0, "matrices": None, "matrix_edges": 0,
                                                   "lone_split": 0, "lone_muon_split": 0}


def test_a_bad_count_on_the_command_line_names_the_flag_and_the_forms() -> None:
    result = CliRunner().invoke(app, ["estimate", "--params", "7X"])
    assert result.exit_code == 2
    text = " ".join(result.output.replace("│", " ").split())
    assert "Invalid value for '--params': '7X' is not a count; give a whole number such as 7B, 1.5e9, 350M" in text


def test_an_integer_recipe_key_is_a_count_too() -> None:
    recipe = config.loads("script: t.py\ntrain: {steps: 10K}\nzero: {param_persistence_threshold: 1e5}\n",
                          overrides=["zero.prefetch_units=2"])
    assert (recipe.train.steps, recipe.zero.param_persistence_threshold) == (10_000, 100_000)
    with pytest.raises(ConfigError, match=r"<recipe>:2: train.steps: expected an integer: '10X' is not a count"):
        config.loads("script: t.py\ntrain: {steps: 10X}\n")
