"""What `zerorun tune` writes: tuned.yaml (only the winner's keys, with their figures), the tables, the JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rich.console import Console

from zerorun import config
from zerorun.tune import output, space
from zerorun.tune.measure import Status, Trial
from zerorun.tune.space import Budget, Candidate, Dimensions, Rejection
from zerorun.tune.tuner import TuneResult

RECIPES = Path(__file__).parents[2] / "recipes"
BASE = Candidate(2, "none", "none", 8, 2, False, 4.0)
WINNER = Candidate(1, "cpu", "none", 16, 1, False, 4.0)


def _result(recipe: Path, trials: list[Trial]) -> TuneResult:
    dims = Dimensions(space.shardings(), space.micro_batches(8, 2), (False, True), (4.0,))
    nvme = Candidate(2, "nvme", "none", 8, 2, False, 4.0)
    return TuneResult(str(recipe), BASE, Budget(2, 1, 8 * 2**30), dims, 600.0, "runs/quickstart/tune-x", trials,
                      [Rejection(nvme, "NVMe offload needs --nvme-path (a directory on a fast local disk)")])


def _trials(interleaved: tuple[tuple[float, float], ...] = ((1000.0, 1250.0), (990.0, 1260.0))) -> list[Trial]:
    """The recipe (t01) and the winner (t04), then run in turn (t05 t06, t07 t08) at the `interleaved` rates:
    pairs (t04, t05) and (t06, t07)."""
    base = Trial(BASE, Status.MEASURED, "baseline", 1, throughput=1000.0, peak_rss=400 * 2**20)
    win = Trial(WINNER, Status.MEASURED, "micro-batch", 4, throughput=1250.0, peak_rss=420 * 2**20)
    for k, (b, w) in enumerate(interleaved):
        base.fold(Trial(BASE, Status.MEASURED, "verify", 5 + 2 * k, throughput=b))
        win.fold(Trial(WINNER, Status.MEASURED, "verify", 6 + 2 * k, throughput=w))
    return [base, win,
            Trial(Candidate(0, "none", "none", 8, 2, False, 4.0), Status.OUT_OF_MEMORY, "sharding", 2,
                  cause="OutOfMemoryError: CUDA out of memory"),
            Trial(Candidate(3, "none", "none", 8, 2, False, 4.0), Status.SLOWER, "sharding", 3, throughput=700.0,
                  cause="its best step 710 tokens/s < 0.95 x t01's 1,000")]


def test_tuned_yaml_changes_only_the_winners_keys_each_with_its_measured_figure(tmp_path: Path) -> None:
    recipe = tmp_path / "quickstart.yaml"
    shutil.copy(RECIPES / "quickstart.yaml", recipe)
    shutil.copy(RECIPES / "train_gpt.py", tmp_path / "train_gpt.py")
    out = output.write_tuned(_result(recipe, _trials()), tmp_path / "quickstart.tuned.yaml", None)
    text = out.read_text()
    tuned, original = config.load(out), config.load(recipe)
    assert (tuned.zero.stage, tuned.zero.offload_optimizer.device) == (1, "cpu")
    assert (tuned.train.micro_batch_size, tuned.train.grad_accum_steps) == (16, 1)
    assert tuned.optimizer == original.optimizer and tuned.train.steps == original.train.steps
    figure = "t04 measured 1,250 tokens/s = 1.26x (1.25-1.26 over 2 interleaved pairs) the recipe, peak RSS 0.41 GiB/rank"
    assert f"  stage: 1  # tuned: was 2; {figure}" in text
    assert f"  micro_batch_size: 16  # tuned: was 8; {figure}" in text
    assert f"  grad_accum_steps: 1  # tuned: was 2; {figure}" in text
    assert text.count("# tuned:") == 4  # stage, offload device, micro-batch, accumulation: nothing else
    body = text.split("\n", 2)[2]  # after the two header lines
    added = ("  offload_optimizer:",)  # the new key's section, under zero:
    kept = [line for line in body.splitlines() if "tuned:" not in line and line not in added]
    changed = ("  stage: 2", "  micro_batch_size: 8", "  grad_accum_steps: 2")
    header = "# The quick start: a 4-layer GPT on synthetic tokens, 2 CPU workers on gloo, ZeRO stage 2."
    assert kept == [header.replace("stage 2.", "stage 1 (tuned; was 2).") if line == header else line
                    for line in recipe.read_text().splitlines() if line not in changed]  # issue 57: "stage 2" stayed


def test_a_tuned_file_elsewhere_points_at_the_same_script(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    out = output.write_tuned(_result(RECIPES / "quickstart.yaml", _trials()), tmp_path / "elsewhere" / "t.yaml", None)
    assert Path(config.load(out).script).resolve() == (RECIPES / "train_gpt.py").resolve()  # relative, via ..


def test_without_a_winner_nothing_is_written(tmp_path: Path) -> None:
    failed = [t for t in _trials() if not t.ok]
    assert output.write_tuned(_result(RECIPES / "quickstart.yaml", failed), tmp_path / "t.yaml", None) is None
    assert not (tmp_path / "t.yaml").exists()


def test_the_ranked_table_puts_the_winner_first_and_says_why_the_others_lost() -> None:
    result = _result(RECIPES / "quickstart.yaml", _trials())
    assert [t.index for t in output.ranked(result.trials)] == [4, 1, 3, 2]
    console = Console(width=250, record=True)
    console.print(output.render_final(result, "quickstart.tuned.yaml"))
    text = console.export_text()
    assert "stage 1, optimizer->cpu, micro 16 x 1, bucket 4" in text and "1.25" not in text.split("t01")[0]
    assert "OutOfMemoryError: CUDA out of memory" in text and "stage 2, optimizer->nvme" in text
    assert "Fastest that fits: t04 stage 1, optimizer->cpu, micro 16 x 1, bucket 4: 1,250 tokens/s, 1.26x " \
           "(1.25-1.26 over 2 interleaved pairs) your recipe." in text


def test_the_json_is_complete_and_serialisable() -> None:
    data = json.loads(json.dumps(output.as_json(_result(RECIPES / "quickstart.yaml", _trials()), "t.yaml")))
    assert data["winner"]["candidate"] == {"stage": 1, "offload_optimizer": "cpu", "offload_param": "none",
                                           "micro_batch": 16, "grad_accum": 1, "checkpointing": False,
                                           "bucket_mb": 4.0, "host_share": 1.0}
    assert [t["status"] for t in data["trials"]] == ["measured", "measured", "stopped: slower", "out of memory"]
    assert data["rejected"][0]["reason"].startswith("NVMe offload needs --nvme-path")


def test_a_measured_trial_over_the_budget_or_with_another_batch_cannot_win() -> None:
    from zerorun.tune.tuner import judge

    cpu_only, gpu = Budget(2, 1, 8 * 2**30), Budget(2, 1, 8 * 2**30, gpu_bytes=2 * 2**30)
    fits = Trial(BASE, Status.MEASURED, throughput=1.0, peak_rss=3 * 2**30, samples_per_step={16})
    judge(fits, cpu_only)
    assert fits.ok
    big = Trial(BASE, Status.MEASURED, throughput=1.0, peak_rss=5 * 2**30, samples_per_step={16})
    judge(big, cpu_only)
    assert big.status is Status.OVER_BUDGET and big.cause == "peak 5.00 GiB RSS/rank > budget 4.00 GiB"
    on_gpu = Trial(BASE, Status.MEASURED, throughput=1.0, peak_gpu=3 * 2**30, peak_rss=2**30, samples_per_step={16})
    judge(on_gpu, gpu)
    assert on_gpu.status is Status.OVER_BUDGET and "GPU/rank > budget 2.00 GiB" in on_gpu.cause
    other = Trial(BASE, Status.MEASURED, throughput=1.0, peak_rss=2**30, samples_per_step={4})
    judge(other, cpu_only)
    assert other.status is Status.INVALID and other.cause == "the script ran 4 samples per step, not 8 x 2"
    ignored = Trial(BASE, Status.MEASURED, throughput=1.0, peak_rss=2**30, samples_per_step={4})
    judge(ignored, cpu_only, batch_honoured=False)  # the baseline showed the script picks its own batch
    assert ignored.ok
