"""The tuner's candidate space and its pruning by the estimate: pure functions, checked against the planner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun import config, estimate
from zerorun.errors import ZerorunError
from zerorun.tune import space
from zerorun.tune.space import Budget, Candidate, Dimensions

GIB = 2**30
SHAPE = estimate.ModelShape(params=100_000_000)
SETTINGS = estimate.Settings("fp32")


def test_micro_batches_keep_the_global_batch_and_put_the_recipes_first() -> None:
    pairs = space.micro_batches(8, 2)
    assert pairs[0] == (8, 2)
    assert sorted(pairs) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
    assert all(m * a == 16 for m, a in pairs)


def test_a_per_rank_batch_with_many_divisors_keeps_those_nearest_the_recipes() -> None:
    pairs = space.micro_batches(32, 32)  # 1024 = 2^10: eleven divisors
    assert len(pairs) == space.MAX_MICRO_BATCHES and pairs[0] == (32, 32)
    assert {m for m, _ in pairs} == {4, 8, 16, 32, 64, 128, 256, 2}


def test_micro_batches_that_would_change_the_global_batch_are_refused_unless_allowed() -> None:
    with pytest.raises(ZerorunError, match="do not divide the per-rank batch 16"):
        space.micro_batches(8, 2, explicit=(3, 8))
    assert space.micro_batches(8, 2, allow_batch_change=True, explicit=(3, 8)) == ((8, 2), (3, 2))
    assert space.micro_batches(8, 2, allow_batch_change=True) == ((8, 2), (2, 2), (4, 2), (16, 2), (32, 2))


def test_bucket_sizes_default_to_a_quarter_and_four_times_the_recipes() -> None:
    assert space.bucket_sizes(25.0) == (25.0, 6.25, 100.0)
    assert space.bucket_sizes(25.0, (100.0, 25.0)) == (25.0, 100.0)
    assert space.bucket_sizes(25.0, (100.0,)) == (25.0, 100.0)  # the recipe's own is always measured
    with pytest.raises(ZerorunError, match="must be > 0"):
        space.bucket_sizes(25.0, (0.0,))


def test_shardings_follow_the_estimates_order_and_the_allowed_values() -> None:
    assert space.shardings() == tuple(estimate.configurations())
    assert space.shardings((1, 2), ("none", "cpu")) == ((1, "none", "none"), (2, "none", "none"),
                                                        (1, "cpu", "none"), (2, "cpu", "none"))


def test_space_is_the_full_product_fastest_expected_first() -> None:
    dims = Dimensions(space.shardings((2, 3), ("none",)), space.micro_batches(2, 2), (False, True), (25.0, 100.0))
    candidates = space.space(dims)
    assert len(candidates) == len(set(candidates)) == dims.size == 2 * 3 * 2 * 2
    assert candidates[0] == Candidate(2, "none", "none", 4, 1, False, 25.0)  # larger micro-batch, no recomputation
    assert [c.stage for c in candidates[:12]] == [2] * 12


def test_a_candidates_settings_are_recipe_keys_that_load() -> None:
    candidate = Candidate(3, "cpu", "cpu", 4, 2, True, 6.25)
    overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in candidate.settings().items()]
    recipe = config.loads("script: train.py", overrides=overrides)
    assert space.base_candidate(recipe) == candidate


def _budget(cpu_gib: float, gpu_gib: float | None = None) -> Budget:
    return Budget(ranks_per_node=2, nodes=1, cpu_bytes_per_node=cpu_gib * GIB,
                  gpu_bytes=gpu_gib * GIB if gpu_gib else None)


def test_on_a_cpu_only_job_the_need_is_the_estimates_device_and_host_bytes_together() -> None:
    candidate = Candidate(2, "cpu", "none", 2, 1, False, 25.0)
    placed = estimate.place(SHAPE, estimate.Cluster(1, 2), SETTINGS, 2, "cpu", "none", None)
    assert space.need(candidate, SHAPE, _budget(100), SETTINGS) == (0.0, placed.gpu_total + placed.cpu_per_rank)
    assert space.need(candidate, SHAPE, _budget(100, 80), SETTINGS) == (placed.gpu_total, placed.cpu_per_rank)


def test_a_budget_below_the_estimate_rejects_the_candidate_with_the_figure() -> None:
    stage0 = Candidate(0, "none", "none", 2, 1, False, 25.0)
    _, host = space.need(stage0, SHAPE, _budget(1), SETTINGS)  # 16 B/param + buckets: ~1.54 GiB per rank
    rejection = space.check(stage0, SHAPE, _budget(2 * host / GIB * 0.99), SETTINGS, None)
    assert rejection is not None and rejection.need == host
    assert rejection.reason == f"estimate {host / GIB:.2f} GiB RSS/rank > budget {host * 0.99 / GIB:.2f} GiB"
    assert space.check(stage0, SHAPE, _budget(2 * host / GIB * 1.01), SETTINGS, None) is None


def test_a_gpu_budget_is_checked_per_gpu_and_the_host_per_rank() -> None:
    stage3 = Candidate(3, "none", "none", 2, 1, False, 25.0)
    device, _ = space.need(stage3, SHAPE, _budget(100, 80), SETTINGS)
    rejection = space.check(stage3, SHAPE, _budget(100, device / GIB / 2), SETTINGS, None)
    assert rejection is not None and "GPU/rank" in rejection.reason
    offloaded = Candidate(3, "cpu", "cpu", 2, 1, False, 25.0)
    _, host = space.need(offloaded, SHAPE, _budget(100, 80), SETTINGS)
    assert "CPU/rank" in space.check(offloaded, SHAPE, _budget(host / GIB, 80), SETTINGS, None).reason


def test_nvme_candidates_without_a_directory_are_rejected_before_any_estimate() -> None:
    nvme = Candidate(2, "nvme", "none", 2, 1, False, 25.0)
    rejection = space.check(nvme, None, _budget(100), SETTINGS, None)
    assert rejection is not None and "--nvme-path" in rejection.reason
    assert space.check(nvme, None, _budget(100), SETTINGS, "/mnt/nvme") is None


def test_without_the_scripts_shape_the_need_leaves_activations_out() -> None:
    # the script's sequence length and width are unknown to the tuner: checkpointing and the micro-batch
    # change only activations, so the estimate cannot tell them apart and the trials must
    base = Candidate(1, "none", "none", 8, 1, False, 25.0)
    other = Candidate(1, "none", "none", 1, 8, True, 25.0)
    same = [space.need(c, SHAPE, _budget(100), SETTINGS) for c in (base, other)]
    assert same[0] == same[1]


@settings(max_examples=60, deadline=None)
@given(cpu=st.floats(0.1, 64), params=st.integers(10**6, 10**10), nvme=st.booleans())
def test_pruning_splits_the_space_and_only_rejects_what_exceeds_the_budget(cpu: float, params: int, nvme: bool) -> None:
    shape = estimate.ModelShape(params=params)
    dims = Dimensions(space.shardings(), space.micro_batches(2, 2), (False,), (25.0,))
    candidates = space.space(dims)
    budget = _budget(cpu)
    kept, rejected = space.prune(candidates, shape, budget, SETTINGS, "/nvme" if nvme else None)
    assert sorted(kept + [r.candidate for r in rejected]) == sorted(candidates)
    for c in kept:
        assert space.need(c, shape, budget, SETTINGS)[1] <= budget.cpu_bytes_per_rank
    for r in rejected:
        assert (r.candidate.uses_nvme and not nvme) or r.need > budget.cpu_bytes_per_rank
    bigger, _ = space.prune(candidates, shape, _budget(cpu * 2), SETTINGS, "/nvme" if nvme else None)
    assert set(kept) <= set(bigger)  # more memory never rules a candidate out


def test_a_script_declares_the_keys_it_honours(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text('import zerorun\nZERORUN_HONOURS = ["train.activation_checkpointing"]\n')
    assert space.script_honours(script) == ("train.activation_checkpointing",)
    script.write_text("ZERORUN_HONOURS: tuple = ()\n")
    assert space.script_honours(script) == ()
    script.write_text("x = 1\n")
    assert space.script_honours(script) == ()
    script.write_text("import os\nZERORUN_HONOURS = os.environ['X']\n")
    with pytest.raises(ZerorunError, match=r"train.py:2: ZERORUN_HONOURS must be a literal list"):
        space.script_honours(script)
    script.write_text("ZERORUN_HONOURS = ['train.micro_batch_size']\n")
    with pytest.raises(ZerorunError, match="train.micro_batch_size is not a key a script applies itself"):
        space.script_honours(script)


def test_the_standard_gpt_script_declares_checkpointing() -> None:
    from pathlib import Path

    assert space.script_honours(Path(__file__).parents[2] / "recipes/train_gpt.py") == (space.CHECKPOINTING_KEY,)


def test_an_offloaded_optimizer_without_room_on_the_host_keeps_the_share_that_fits_there() -> None:
    """Twin-Flow in the tuner: a host too small for the whole optimizer state keeps what fits, the GPU the rest."""
    from zerorun import estimate
    from zerorun.tune.space import Budget, Candidate, prune

    shape = estimate.ModelShape(params=10**9)
    settings = estimate.Settings("bf16", overlap_optimizer=False, async_checkpoints=False)
    offloaded = Candidate(2, "cpu", "none", 4, 1, False, 25.0)
    roomy, _ = prune([offloaded], shape, Budget(1, 1, 64 * 2**30, gpu_bytes=80 * 2**30), settings, None)
    assert roomy == [offloaded]  # 12 GB on the host fits: all of it there
    kept, rejected = prune([offloaded], shape, Budget(1, 1, 8 * 2**30, gpu_bytes=80 * 2**30), settings, None)
    assert not rejected and kept[0].host_share == 0.5 and "(50% on the host)" in kept[0].label()
    assert kept[0].settings()["zero.offload_optimizer_ratio"] == 0.5
    _, nowhere = prune([offloaded], shape, Budget(1, 1, 2 * 2**30, gpu_bytes=8 * 2**30), settings, None)
    assert len(nowhere) == 1  # neither the host nor the GPU has the room
