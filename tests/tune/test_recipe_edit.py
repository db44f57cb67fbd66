"""tuned.yaml is the user's recipe with only the chosen keys changed: comments, order and the rest kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun import config
from zerorun.tune.recipe_edit import scalar, set_keys

QUICKSTART = (Path(__file__).parents[2] / "recipes/quickstart.yaml").read_text()


def _get(recipe: config.Recipe, key: str) -> object:
    value: object = recipe
    for part in key.split("."):
        value = getattr(value, part)
    return value


def test_values_change_in_place_and_every_comment_and_line_stays() -> None:
    edited = set_keys(QUICKSTART, {"zero.stage": (3, "was 2; t04 measured 412 tokens/s"),
                                   "train.micro_batch_size": (16, "was 8")})
    before, after = QUICKSTART.splitlines(), edited.splitlines()
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    assert changed == [("  stage: 2", "  stage: 3  # tuned: was 2; t04 measured 412 tokens/s"),
                       ("  micro_batch_size: 8", "  micro_batch_size: 16  # tuned: was 8")]


def test_missing_keys_go_into_their_section_and_missing_sections_at_the_end() -> None:
    edited = set_keys(QUICKSTART, {"zero.offload_optimizer.device": ("cpu", "t02"),
                                   "train.activation_checkpointing": (True, "t03"),
                                   "telemetry.interval_s": (0.5, "")})
    recipe = config.loads(edited)
    assert recipe.zero.offload_optimizer.device == "cpu" and recipe.train.activation_checkpointing is True
    assert recipe.telemetry.interval_s == 0.5 and recipe.zero.bucket_mb == 4 and recipe.train.steps == 60
    lines = edited.splitlines()
    assert lines[lines.index("  bucket_mb: 4") + 1:][:2] == ["  offload_optimizer:", "    device: cpu  # tuned: t02"]
    assert lines[lines.index("  seed: 0") + 1] == "  activation_checkpointing: true  # tuned: t03"
    assert lines[-2:] == ["telemetry:", "  interval_s: 0.5"]
    assert [line for line in QUICKSTART.splitlines() if "#" in line] == \
        [line for line in lines if "#" in line and "tuned:" not in line]


def test_a_shorthand_becomes_a_mapping_when_another_of_its_keys_is_set() -> None:
    text = "script: t.py\nzero:\n  stage: 2\n  offload_optimizer: cpu   # host memory\n"
    edited = set_keys(text, {"zero.offload_optimizer.device": ("nvme", "t05"),
                             "zero.offload_optimizer.nvme_path": ("/local/nvme", "")})
    assert edited.splitlines()[3] == \
        "  offload_optimizer: {device: nvme, nvme_path: /local/nvme}   # host memory  # tuned: t05"
    off = config.loads(edited).zero.offload_optimizer
    assert (off.device, off.nvme_path) == ("nvme", "/local/nvme")


def test_flow_mappings_are_edited_in_place() -> None:
    text = "script: t.py\nzero: {stage: 2, bucket_mb: 4}  # compact\n"
    edited = set_keys(text, {"zero.stage": (1, "s"), "zero.offload_optimizer.device": ("cpu", "o")})
    assert edited == \
        "script: t.py\nzero: {stage: 1, bucket_mb: 4, offload_optimizer: {device: cpu}}  # compact  # tuned: s; o\n"


def test_scalars_are_written_so_that_yaml_reads_them_back() -> None:
    assert [scalar(v) for v in (True, 3, 6.25, 100.0, "cpu", "/a b", "true", "1e5")] == \
        ["true", "3", "6.25", "100.0", "cpu", '"/a b"', '"true"', '"1e5"']


def test_a_section_cannot_be_set_as_a_value() -> None:
    with pytest.raises(ValueError, match="zero is a section"):
        set_keys(QUICKSTART, {"zero": (1, "")})


KEYS = {"zero.stage": st.integers(1, 3),  # not 0: stage 0 with optimizer offload is refused by config
        "zero.bucket_mb": st.sampled_from([1.0, 6.25, 100.0]),
        "zero.offload_optimizer.device": st.sampled_from(["none", "cpu"]),
        "train.micro_batch_size": st.integers(1, 64), "train.grad_accum_steps": st.integers(1, 8),
        "train.activation_checkpointing": st.booleans(), "precision.dtype": st.sampled_from(["fp32", "bf16"])}


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(KEYS)), st.none(), min_size=1).flatmap(
    lambda keys: st.fixed_dictionaries({k: KEYS[k] for k in keys})))
def test_any_set_of_changes_reads_back_exactly_and_leaves_every_other_key(changes: dict) -> None:
    edited = set_keys(QUICKSTART, {k: (v, f"comment for {k}") for k, v in changes.items()})
    before, after = config.loads(QUICKSTART), config.loads(edited)
    for key, value in changes.items():
        assert _get(after, key) == value
    for key in ("script", "args", "nproc_per_node", "optimizer.lr", "train.steps", "train.clip_grad_norm"):
        assert _get(after, key) == _get(before, key)
    assert all(line in edited for line in QUICKSTART.splitlines() if line.lstrip().startswith("#"))
