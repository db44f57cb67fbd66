"""The search order: pure decisions over simulated results, against an exhaustive sweep of the same model."""

from __future__ import annotations

import math
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from zerorun.tune import search, space
from zerorun.tune.measure import Status, Trial
from zerorun.tune.space import Candidate, Dimensions

DIMS = Dimensions(space.shardings((0, 1, 2, 3), ("none", "cpu")), space.micro_batches(4, 4), (False, True),
                  (6.25, 25.0, 100.0))
BASE = Candidate(2, "none", "none", 4, 4, False, 25.0)
Model = Callable[[Candidate], "float | None"]  # throughput, or None: out of memory


def simulate(model: Model, rejected: set[Candidate] = frozenset(), dims: Dimensions = DIMS, base: Candidate = BASE,
             early_stop: bool = False) -> list[Trial]:
    """Run the search to its end with `model` standing in for the trials (as the tuner's loop does)."""
    trials: dict[Candidate, Trial] = {}
    while (picked := search.next_candidate(base, dims, trials, rejected)) is not None:
        candidate, phase = picked
        assert candidate not in trials and candidate not in rejected, f"{candidate} proposed twice or rejected"
        value = model(candidate)
        best = search.best(trials.values())
        if value is None:
            trial = Trial(candidate, Status.OUT_OF_MEMORY, phase, len(trials) + 1)
        elif early_stop and best is not None and value < best.throughput:
            trial = Trial(candidate, Status.SLOWER, phase, len(trials) + 1, throughput=value)
        else:
            trial = Trial(candidate, Status.MEASURED, phase, len(trials) + 1, throughput=value)
        trials[candidate] = trial
    return list(trials.values())


def separable(sharding: dict, micro: Callable[[int], float], ckpt: float, bucket: Callable[[float], float]) -> Model:
    return lambda c: (sharding[c.sharding] * micro(c.micro_batch) * (ckpt if c.checkpointing else 1.0)
                      * bucket(c.bucket_mb))


def peaked(best: float) -> Callable[[float], float]:
    """Unimodal in log scale, highest at `best`."""
    return lambda x: 1.0 / (1.0 + abs(math.log2(x / best)))


def test_baseline_then_every_sharding_at_the_recipes_settings() -> None:
    trials = simulate(lambda c: 100.0)
    assert trials[0].candidate == BASE and trials[0].phase == "baseline"
    shardings = [t.candidate for t in trials if t.phase == "sharding"]
    assert [c.sharding for c in shardings] == [s for s in DIMS.shardings if s != BASE.sharding]
    assert all((c.micro_batch, c.checkpointing, c.bucket_mb) == (4, False, 25.0) for c in shardings)


def test_a_sharding_whose_recipe_settings_do_not_fit_runs_its_nearest_variant_that_does() -> None:
    rejected = {c for c in space.space(DIMS) if c.stage == 0 and (c.micro_batch > 4 or not c.checkpointing)}
    trials = simulate(lambda c: 100.0, rejected)
    stage0 = [t.candidate for t in trials if t.phase == "sharding" and t.candidate.stage == 0]
    assert stage0 == [Candidate(0, "none", "none", 4, 4, True, 25.0)]  # checkpointing before a smaller micro-batch


def test_micro_batches_grow_while_they_improve_and_stop_at_the_first_decline() -> None:
    model = separable({s: 1.0 for s in DIMS.shardings}, lambda m: {1: 1, 2: 2, 4: 3, 8: 4, 16: 3.5}[m], 0.7,
                      lambda b: 1.0)
    trials = simulate(model)
    tried = [t.candidate.micro_batch for t in trials
             if t.phase == "micro-batch" and t.candidate.sharding == BASE.sharding]
    assert tried == [8, 16]  # 16 is worse than 8: no further, and 2 (below the recipe's 4) is not needed
    assert search.best(trials).candidate.micro_batch == 8


def test_a_micro_batch_that_ran_out_of_memory_is_the_last_one_tried_upwards() -> None:
    model = separable({s: 1.0 + (s == BASE.sharding) for s in DIMS.shardings}, lambda m: float(m), 0.7, lambda b: 1.0)
    trials = simulate(lambda c: None if c.micro_batch >= 16 and not c.checkpointing else model(c))
    base_sharding = [t for t in trials if t.candidate.sharding == BASE.sharding]
    assert [t.candidate.micro_batch for t in base_sharding if t.phase == "micro-batch"] == [8, 16]
    assert any(t.phase == "checkpointing" and t.candidate.micro_batch == 16 and t.status is Status.MEASURED
               for t in base_sharding)  # checkpointing makes it fit
    assert search.best(trials).candidate == Candidate(*BASE.sharding, 16, 1, True, 25.0)


def test_checkpointing_is_never_measured_where_everything_fits_or_the_script_does_not_honour_it() -> None:
    model = separable({s: 1.0 for s in DIMS.shardings}, peaked(4), 0.7, peaked(25.0))
    assert not [t for t in simulate(model) if t.candidate.checkpointing]
    without = Dimensions(DIMS.shardings, DIMS.micro_batches, (False,), DIMS.bucket_mb)
    oom = simulate(lambda c: None if c.micro_batch >= 8 else model(c), dims=without)
    assert not [t for t in oom if t.candidate.checkpointing]


def test_bucket_sizes_are_walked_from_the_best_configuration() -> None:
    model = separable({s: 1.0 + (s == (1, "none", "none")) for s in DIMS.shardings}, peaked(4), 0.7, peaked(100.0))
    trials = simulate(model)
    buckets = [t.candidate for t in trials if t.phase == "bucket"]
    assert [c.bucket_mb for c in buckets] == [100.0]  # up improves, and 6.25 below is not needed
    assert all(c.sharding == (1, "none", "none") for c in buckets)
    assert search.best(trials).candidate == Candidate(1, "none", "none", 4, 4, False, 100.0)


@st.composite
def landscapes(draw: st.DrawFn) -> Model:
    factors = draw(st.lists(st.floats(0.2, 5.0), min_size=len(DIMS.shardings), max_size=len(DIMS.shardings),
                            unique=True))
    micro_peak = draw(st.sampled_from([1, 2, 4, 8, 16]))
    bucket_peak = draw(st.sampled_from([6.25, 25.0, 100.0]))
    ckpt = draw(st.floats(0.5, 0.95))
    return separable(dict(zip(DIMS.shardings, factors)), peaked(micro_peak), ckpt, peaked(bucket_peak))


@settings(max_examples=150, deadline=None)
@given(model=landscapes(), early_stop=st.booleans())
def test_on_separable_unimodal_landscapes_the_search_finds_the_exhaustive_best(model: Model, early_stop: bool) -> None:
    trials = simulate(model, early_stop=early_stop)
    exhaustive = max(space.space(DIMS), key=model)
    assert search.best(trials).candidate == exhaustive
    assert len(trials) <= 1 + len(DIMS.shardings) + 2 * len(DIMS.micro_batches) + len(DIMS.bucket_mb)


def _measured(candidate: Candidate, throughput: float, index: int) -> Trial:
    return Trial(candidate, Status.MEASURED, "sharding", index, throughput=throughput)


def test_rivals_close_to_the_best_are_run_again_until_the_median_of_three_decides() -> None:
    a, b, c = (Candidate(s, "none", "none", 4, 4, False, 25.0) for s in (1, 2, 3))
    trials = {a: _measured(a, 100.0, 1), b: _measured(b, 95.0, 2), c: _measured(c, 80.0, 3)}
    asked = []
    while (again := search.next_confirmation(trials.values())) is not None:
        asked.append(again)
        repeat = _measured(again, {a: 90.0, b: 99.0}[again], 10 + len(asked))
        trials[again].fold(repeat)
    assert asked == [a, a, b, b]  # c is more than 10% behind: never repeated
    assert trials[a].throughput == 90.0 and trials[b].throughput == 99.0  # medians of (100, 90, 90), (95, 99, 99)
    assert search.best(trials.values()).candidate == b


def test_a_clear_winner_is_not_run_again() -> None:
    a, b = (Candidate(s, "none", "none", 4, 4, False, 25.0) for s in (1, 2))
    assert search.next_confirmation([_measured(a, 100.0, 1), _measured(b, 85.0, 2)]) is None


def test_the_best_is_measured_again_every_few_runs_and_new_trials_meet_its_latest_run() -> None:
    a, b = (Candidate(s, "none", "none", 4, 4, False, 25.0) for s in (1, 2))
    best = _measured(a, 186.0, 1)  # measured in a quiet minute
    trials = [best, _measured(b, 70.0, 2)]
    assert search.next_recheck(trials, runs_so_far=2) is None
    assert search.next_recheck(trials, runs_so_far=1 + search.RECHECK_EVERY) == a
    best.fold(_measured(a, 74.0, 5))  # the machine got busy: its repeat runs at today's load
    assert search.next_recheck(trials, runs_so_far=5) is None  # just measured
    assert search.latest(best) == 74.0  # what a new trial is held against, not the quiet 186
    assert search.latest(trials[1]) == 70.0
