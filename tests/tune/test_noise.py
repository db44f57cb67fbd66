"""A gain over the recipe is claimed only from interleaved runs: pairs, their ratios' spread, the machine's load."""

from __future__ import annotations

from pathlib import Path

from tests.tune.test_output import BASE, RECIPES, WINNER, _result
from zerorun import config
from zerorun.tune import load, noise, output
from zerorun.tune.load import Load, Reading
from zerorun.tune.measure import Status, Trial


def _run(candidate, index: int, rate: float) -> Trial:
    return Trial(candidate, Status.MEASURED, "verify", index, throughput=rate)


def test_the_recipe_and_the_winner_run_in_turn_until_two_adjacent_pairs_are_measured() -> None:
    base, win = _run(BASE, 1, 500.0), _run(WINNER, 4, 1090.0)
    order, last = [], 4
    while (picked := noise.next_run(base, win, last)) is not None:
        last += 1
        order.append(picked)
        (base if picked == BASE else win).fold(_run(picked, last, 1000.0))
    assert order == [BASE, WINNER, BASE]  # t04 (the winner) and t05 (the recipe) already make a pair
    assert noise.compare(base, win).ratios == (1090.0 / 1000.0, 1000.0 / 1000.0)  # (t04, t05), (t06, t07)
    assert noise.next_run(base, base, 9) is None  # the recipe won: nothing to compare


def test_a_gain_from_one_early_baseline_on_a_busy_machine_is_inside_the_noise_and_the_recipe_stays(
        tmp_path: Path) -> None:
    """Issue 57: "2.18x your recipe" from one baseline run taken while the machine was busy; run in turn
    afterwards the two were equal. The ratio comes from the pairs only, and the tuned recipe claims nothing."""
    recipe = tmp_path / "quickstart.yaml"
    recipe.write_text((RECIPES / "quickstart.yaml").read_text())
    (tmp_path / "train_gpt.py").write_text((RECIPES / "train_gpt.py").read_text())
    result = _result(recipe, [])
    base, win = _run(BASE, 1, 500.0), _run(WINNER, 4, 1090.0)  # the early busy baseline: 2.18x
    base.fold(_run(BASE, 5, 1000.0))  # then in turn: t05 t06 t07
    win.fold(_run(WINNER, 6, 1010.0))
    base.fold(_run(BASE, 7, 1060.0))
    result.trials = [base, win]
    comparison = result.comparison
    assert comparison is not None and comparison.ratios == (1.09, 1010.0 / 1060.0) and not comparison.supported
    assert result.winner is win and result.chosen is base
    line = output.verdict(result)
    assert line.startswith("No gain over your recipe beyond the noise: t04") and "2.18" not in line
    assert "measured 1.02x (0.95-1.09 over 2 interleaved pairs) your recipe; your recipe stays as it is." in line
    tuned = output.write_tuned(result, tmp_path / "tuned.yaml", None)
    text = tuned.read_text()
    assert "# tuned:" not in text and "x the recipe" not in text and "your recipe's own configuration" in text
    assert config.load(tuned).zero.stage == config.load(recipe).zero.stage


def test_without_interleaved_pairs_no_gain_is_claimed_and_the_recipe_stays(tmp_path: Path) -> None:
    recipe = tmp_path / "quickstart.yaml"
    recipe.write_text((RECIPES / "quickstart.yaml").read_text())
    (tmp_path / "train_gpt.py").write_text((RECIPES / "train_gpt.py").read_text())
    result = _result(recipe, [_run(BASE, 1, 500.0), _run(WINNER, 4, 1090.0)])
    assert result.chosen is result.trials[0]
    assert output.verdict(result) == ("No gain over your recipe claimed: t04 stage 1, optimizer->cpu, micro 16 x 1, "
                                      "bucket 4: 1,090 tokens/s was not compared with it in interleaved runs (the "
                                      "time budget ended first; raise --budget-min); your recipe stays as it is.")
    text = output.write_tuned(result, tmp_path / "tuned.yaml", None).read_text()
    assert "# tuned:" not in text and "2.18" not in text


def test_other_processes_cpu_is_the_machines_less_this_process_and_its_children() -> None:
    before = Reading(wall_s=100.0, machine_busy_s=1000.0, own_s=5.0, children_s=50.0, loadavg=1.0)
    after = Reading(wall_s=110.0, machine_busy_s=1018.0, own_s=5.5, children_s=55.5, loadavg=3.2)
    measured = Load.between(before, after, cpus=2)  # 18 core-s busy, 6 of them ours: 1.2 cores others'
    assert measured == Load(cpus=2, others_cores=1.2, loadavg=3.2) and measured.loaded
    quiet = Load.between(before, Reading(110.0, 1006.5, 5.5, 55.5, 0.4), cpus=2)
    assert quiet.others_cores == 0.05 and not quiet.loaded
    assert load.summary([quiet]) is None
    said = load.summary([quiet, measured])
    assert said is not None and said.startswith("the machine was loaded: other processes kept 0.6 of 2 cores busy")
    assert noise.Comparison((1.2, 1.3)).supported and not noise.Comparison((1.2, 1.02)).supported


def test_after_the_search_the_tuner_runs_the_recipe_and_the_winner_in_turn() -> None:
    """The tuner's own loop (`tuner._next`), with results standing in for trials: search, then B/W in turn."""
    from dataclasses import replace

    from zerorun.tune import tuner
    from zerorun.tune.space import Budget, Dimensions

    rival = replace(BASE, stage=1, offload_optimizer="cpu")
    dims = Dimensions((BASE.sharding, rival.sharding), ((BASE.micro_batch, BASE.grad_accum),), (False,), (4.0,))
    session = tuner.Session("r.yaml", tuner.TuneOptions(), BASE, Budget(2, 1, 8 * 2**30), dims, None, None,
                            [], [], [], None)
    rates, trials, phases = {BASE: 500.0, rival: 1000.0}, {}, []
    while (picked := tuner._next(session, trials)) is not None:
        candidate, phase = picked
        index = 1 + sum(1 + len(t.repeats) for t in trials.values())
        trial = _run(candidate, index, rates[candidate])
        trials[candidate].fold(trial) if candidate in trials else trials.__setitem__(candidate, trial)
        phases.append((phase, candidate))
        rates[BASE] = 1000.0  # the machine got quieter after the first run: the recipe is as fast
    assert phases == [("baseline", BASE), ("sharding", rival), ("verify", BASE), ("verify", rival)]
    comparison = noise.compare(trials[BASE], trials[rival])
    assert comparison.ratios == (2.0, 1.0) and not comparison.supported  # (t01, t02) and (t03, t04)
    # with the time left only for the interleaved runs, they come before the search's next candidate
    wide = Dimensions((BASE.sharding, rival.sharding, (3, "none", "none")), dims.micro_batches, (False,), (4.0,))
    session.dims = wide
    early = {BASE: _run(BASE, 1, 500.0), rival: _run(rival, 2, 1000.0)}
    assert tuner._next(session, early)[1] == "sharding" and tuner._next(session, early, verify_now=True) == (
        BASE, "verify")
