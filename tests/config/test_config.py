"""Recipe validation: each kind of mistake gives one message naming file:line, the dotted key and what is expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerorun import config
from zerorun.errors import ConfigError


def _error(text: str, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        config.loads(text, "r.yaml", overrides)
    return str(info.value)


@pytest.mark.parametrize("text, expected", [
    ("script: t.py\nzero:\n  stgae: 2\n", "r.yaml:3: zero.stgae: unknown key; did you mean 'stage'?"),
    ("script: t.py\noptimiser: {lr: 1}\n", "r.yaml:2: optimiser: unknown key; did you mean 'optimizer'?"),
    ("script: t.py\nzero: {zzz: 1}\n", "r.yaml:2: zero.zzz: unknown key; valid keys here: aio, allgather_bucket_mb,"),
    ("script: t.py\nzero:\n  stage: two\n", "r.yaml:3: zero.stage: expected an integer, got str 'two'."),
    ("script: t.py\nzero:\n  overlap_comm: 1\n", "r.yaml:3: zero.overlap_comm: expected true or false, got int 1."),
    ("script: t.py\ntrain: {steps: 2.5}\n", "r.yaml:2: train.steps: expected an integer, got 2.5."),
    ("script: t.py\nargs: [1, {a: 2}]\n", "r.yaml:2: args[1]: expected a string, got a mapping."),
    ("script: t.py\nenv: [A]\n", "r.yaml:2: env: expected a mapping of NAME: value, got a list."),
    ("script: t.py\nzero:\n  stage: 5\n", "r.yaml:3: zero.stage: must be >= 0 and <= 3, got 5."),
    ("script: t.py\noptimizer: {lr: 0}\n", "r.yaml:2: optimizer.lr: must be > 0, got 0.0."),
    ("script: t.py\nzero: {prefetch_units: aut}\n", "r.yaml:2: zero.prefetch_units: expected auto or an integer, got str 'aut'; did you mean 'auto'?"),
    ("script: t.py\nzero: {prefetch_units: -1}\n", "r.yaml:2: zero.prefetch_units: must be >= 0, got -1."),
    ("script: t.py\nprecision: bf61\n", "r.yaml:2: precision.dtype: expected one of fp32, bf16, fp16, got str 'bf61'; did you mean 'bf16'?"),
    ("script: t.py\noptimizer: {betas: [0.9, 1.5]}\n", "r.yaml:2: optimizer.betas: expected two numbers in [0, 1), got [0.9, 1.5]."),
    ("zero:\n  stage: 1\n", "r.yaml: script: missing; every recipe names its training script"),
    ("script: t.py\nzero: [\n", "r.yaml:3: not valid YAML:"),
    ("- a\n- b\n", "r.yaml:1: a recipe is a mapping of keys"),
    ("script: t.py\nscript: u.py\n", "r.yaml:2: script: given twice (first at line 1)."),
    ("script: t.py\nzero: {offload_optimizer: nvme}\n", "r.yaml:2: zero.offload_optimizer.nvme_path: required when device is nvme"),
    ("script: t.py\nzero: {stage: 2, offload_param: cpu}\n", "r.yaml:2: zero.offload_param.device: parameter offload needs zero.stage: 3"),
    ("script: t.py\nzero: {stage: 3, offload_param: cpu}\n", "r.yaml:2: zero.offload_param.device: parameter offload needs zero.offload_optimizer too"),
])
def test_each_mistake_names_file_line_key_and_expectation(text: str, expected: str) -> None:
    assert _error(text).startswith(expected)


@pytest.mark.parametrize("override, expected", [
    ("zero.stage=7", "--set zero.stage=7: zero.stage: must be >= 0 and <= 3, got 7."),
    ("zero.stag=1", "--set zero.stag=1: zero.stag: unknown key; did you mean 'stage'?"),
    ("foo", "--set foo: expected KEY=VALUE, e.g. --set zero.stage=3."),
    ("precision.dtype=fp8", "--set precision.dtype=fp8: precision.dtype: expected one of fp32, bf16, fp16"),
    ("zero.overlap_publish=1", "--set zero.overlap_publish=1: zero.overlap_publish: expected one of auto, true, "
                               "false, got int 1."),
])
def test_set_overrides_are_validated_and_named(override: str, expected: str) -> None:
    assert _error("script: t.py\n", (override,)).startswith(expected)


def test_overrides_values_shorthands_and_scientific_numbers() -> None:
    recipe = config.loads("script: t.py\nprecision: bf16\nargs: --steps 3 --x\noptimizer: {lr: 3e-4}\n"
                          "zero: {param_persistence_threshold: 1e5}\n", "r.yaml",
                          ["zero.stage=3", "precision.initial_loss_scale=1024", "optimizer.betas=[0.8, 0.9]"])
    assert recipe.precision.dtype == "bf16" and recipe.precision.initial_loss_scale == 1024.0
    assert recipe.args == ["--steps", "3", "--x"]
    assert recipe.optimizer.lr == 3e-4 and recipe.optimizer.betas == [0.8, 0.9]
    assert recipe.zero.stage == 3 and recipe.zero.param_persistence_threshold == 100_000


def test_set_on_a_shorthand_section_expands_it() -> None:
    recipe = config.loads("script: t.py\nprecision: fp16\n", "r.yaml", ["precision.initial_loss_scale=8"])
    assert recipe.precision.dtype == "fp16" and recipe.precision.initial_loss_scale == 8.0


def test_recipe_round_trips_through_the_worker_json() -> None:
    recipe = config.loads("script: t.py\nzero: {stage: 1, wrap: [Block]}\nenv: {A: 1, B: true}\n", "r.yaml")
    again = config.from_dict(json.loads(config.to_json(recipe)))
    again.source = recipe.source
    assert again == recipe and recipe.env == {"A": "1", "B": "true"}


def test_load_resolves_script_relative_to_the_recipe_and_checks_it_exists(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "ok.yaml").write_text("script: train.py\n")
    recipe = config.load(tmp_path / "ok.yaml")
    assert recipe.script == str(tmp_path / "train.py") and recipe.name == "ok"
    (tmp_path / "bad.yaml").write_text("name: x\nscript: nope.py\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: script: .*nope.py does not exist"):
        config.load(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match=r"missing.yaml: cannot read the recipe"):
        config.load(tmp_path / "missing.yaml")


def test_every_shipped_recipe_is_valid() -> None:
    for path in Path(__file__).parents[2].joinpath("recipes").glob("*.yaml"):
        config.load(path)


# --- hostile input: bounded parsing ---------------------------------------------------------------


def _alias_bomb(levels: int) -> str:
    """`d0` holds 9 keys; each next level holds 9 aliases of the one before: 9**(levels+1) values in ~1 KB."""
    text = "script: t.py\nd0: &d0 {" + ", ".join(f"k{j}: 1" for j in range(9)) + "}\n"
    for i in range(1, levels + 1):
        text += f"d{i}: &d{i} {{" + ", ".join(f"k{j}: *d{i - 1}" for j in range(9)) + "}\n"
    return text


def test_a_yaml_alias_bomb_is_refused_quickly_with_its_line() -> None:
    import time

    bomb = _alias_bomb(8)  # ~9**9 = 387 million values, d4 (line 6) the first past the limit
    assert len(bomb) < 1000
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^r\.yaml:6: this value expands to more than 100,000 YAML values"):
        config.loads(bomb, "r.yaml")
    assert time.monotonic() - started < 5.0
    with pytest.raises(ConfigError, match=r"r\.yaml:2: an alias refers to the value that holds it"):
        config.loads("script: t.py\nm: &m {a: *m}\n", "r.yaml")


def test_a_moderate_alias_expansion_is_refused_too() -> None:
    with pytest.raises(ConfigError, match="expands to more than"):  # ~9**6 = 531,441 values
        config.loads(_alias_bomb(5), "r.yaml")


def test_tagged_yaml_is_refused_with_its_line_not_a_traceback() -> None:
    with pytest.raises(ConfigError, match=r"^r\.yaml:3: not allowed in a recipe: could not determine a constructor "
                                          r"for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"):
        config.loads("script: t.py\nname: x\nboom: !!python/object/apply:os.system ['true']\n", "r.yaml")


def test_a_recipe_over_the_size_limit_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("script: t.py\n" + "# " + "x" * config.MAX_RECIPE_BYTES + "\n")
    with pytest.raises(ConfigError, match=r"huge\.yaml: the recipe is over 1 MiB; a recipe holds settings"):
        config.load(path)


@pytest.mark.parametrize("key", ["A=B", "1ABC", "A B", ""])
def test_an_env_key_that_is_no_variable_name_is_refused_at_load(key: str) -> None:
    with pytest.raises(ConfigError, match=r"^r\.yaml:2: env\..*is not an environment variable name"):
        config.loads(f"script: t.py\nenv: {{'{key}': x}}\n", "r.yaml")
