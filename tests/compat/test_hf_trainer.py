"""An unchanged Hugging Face Trainer script trains under `zerorun launch ... --deepspeed ds.json` as under DDP.

Reference: the same script without `--deepspeed` under torchrun with `--use_cpu` (accelerate's CPU
DDP, gloo), 2 ranks (`hf_runs.py` launches every run once per session). zerorun runs it with
`zerorun launch --num_gpus 2 hf_train.py ... --deepspeed ds.json` at ZeRO stages 1, 2 and 3 with
accumulation 2, clipping that bites, and the Trainer's own AdamW (two param groups: no decay for
biases and norms) and linear warmup schedule; and once with the DeepSpeed config's optimizer and
scheduler sections set to "auto" (filled by transformers), against the DDP script following
DeepSpeed's WarmupDecayLR. fp32 losses of every micro-step on every rank agree within 1e-5
relative (measured: <= 1.2e-7, fp32 summation order). Stage 3 loads the pretrained weights through
`deepspeed.zero.Init` and `GatheredParameters`, with GPT-2's tied embedding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.compat import hf_runs
from tests.compat.hf_runs import DS_OPTIMIZER, HF_OPTIMIZER, assert_close, assert_same_saved_model, stage_run

HERE = Path(__file__).parent


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_script_with_its_own_optimizer_trains_as_ddp(hf_workdir: Path, stage: int) -> None:
    reference = hf_runs.ddp(hf_workdir, "ddp_hf", *HF_OPTIMIZER)
    ours = stage_run(hf_workdir, stage)
    assert_close(ours, reference, f"stage {stage}")
    assert ours[0]["lrs"] == reference[0]["lrs"] == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])
    if stage == 3:
        assert "stage 3 units: GPT2Block" in (hf_workdir / "stage3.log").read_text()  # _no_split_modules
        model_bytes = sum(t.numel() * 4 for t in _pretrained(hf_workdir).values())
        for rank, record in enumerate(ours):  # loading never held the whole model on a rank
            assert 0 < record["staged_peak_bytes"] < 0.75 * model_bytes, (rank, record["staged_peak_bytes"])
        assert_same_saved_model(hf_workdir / "out_stage3" / "final", hf_workdir / "out_ddp_hf" / "final")


def _pretrained(tmp: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(tmp / "model" / "model.safetensors")


@pytest.mark.slow
def test_trainer_resumes_from_its_checkpoint_exactly(hf_workdir: Path) -> None:
    """trainer.train(resume_from_checkpoint=...) on the stage 3 run's step-2 checkpoint: the losses after it
    equal the uninterrupted run's bit for bit (weights, Adam moments, schedule, data position)."""
    full = stage_run(hf_workdir, 3)
    resumed = hf_runs.zerorun(hf_workdir, "resumed", hf_runs.stage_config(hf_workdir, 3), *HF_OPTIMIZER,
                              "--resume_from_checkpoint", str(hf_workdir / "out_stage3" / "checkpoint-2"))
    for uninterrupted, after in zip(full, resumed):
        assert after["losses"] == uninterrupted["losses"][4:]


def _update_losses(records: list[dict], accum: int = 2) -> list[float]:
    """Each update's loss over its whole global batch. The Trainer's micro-step loss is the micro-batch's token
    loss sum over the tokens of the global batch, times the world size (average_tokens_across_devices): summed
    over every rank's micro-steps of an update and divided by the world size, the batch's mean token loss."""
    world = len(records)
    updates = len(records[0]["losses"]) // accum
    return [sum(sum(r["losses"][u * accum:(u + 1) * accum]) for r in records) / world for u in range(updates)]


@pytest.mark.slow
def test_trainer_resumes_on_three_ranks_from_a_checkpoint_saved_on_two(hf_workdir: Path) -> None:
    """2 ranks x micro-batch 3 save at update 2; 3 ranks x micro-batch 2 resume from it: the global batch (12
    samples, accumulation 2) and its samples are the same, so updates 3 and 4 see the same data as in the
    uninterrupted 2-rank run, and their mean losses and the final weights equal its own (fp32 summation order
    apart: measured 1.9e-8; with --ignore_data_skip, the wrong samples, 7e-3)."""
    uninterrupted = stage_run(hf_workdir, 3)
    resumed = hf_runs.zerorun(hf_workdir, "resumed_on_3", hf_runs.stage_config(hf_workdir, 3), *HF_OPTIMIZER,
                              "--per_device_train_batch_size", "2", "--resume_from_checkpoint",
                              str(hf_workdir / "out_stage3" / "checkpoint-2"), world=3)
    assert [r["global_step"] for r in resumed] == [4, 4, 4]
    got, want = torch.tensor(_update_losses(resumed)), torch.tensor(_update_losses(uninterrupted)[2:])
    assert got.shape == want.shape == (2,)
    worst = ((got - want).abs() / want.abs()).max().item()
    assert worst <= hf_runs.LOSS_RTOL, f"losses after the resume differ by {worst:.2e} relative: {got} vs {want}"
    assert_same_saved_model(hf_workdir / "out_resumed_on_3" / "final", hf_workdir / "out_stage3" / "final")


@pytest.mark.slow
def test_consolidate_format_hf_writes_what_from_pretrained_loads(hf_workdir: Path) -> None:
    """`zerorun checkpoint consolidate --format hf` on the Trainer's step-2 checkpoint (zerorun's sharded
    one inside it), sharded small: from_pretrained reads the Trainer's own save_model of that step."""
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from zerorun.cli import app

    stage_run(hf_workdir, 3)
    checkpoint = hf_workdir / "out_stage3" / "checkpoint-2"
    out = hf_workdir / "consolidated"
    result = CliRunner().invoke(app, ["checkpoint", "consolidate", str(checkpoint), "--format", "hf", "--out",
                                      str(out), "--max-shard-mb", "0.05"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()  # the Trainer's consolidated save
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.slow
def test_trainer_script_with_the_configs_auto_optimizer_and_scheduler_trains_as_ddp(hf_workdir: Path) -> None:
    reference = hf_runs.ddp(hf_workdir, "ddp_ds_schedule", *DS_OPTIMIZER, "--ds_schedule")
    ours = hf_runs.zerorun(hf_workdir, "auto", HERE / "configs" / "hf_auto_stage2.json", *DS_OPTIMIZER)
    assert_close(ours, reference, "auto optimizer and scheduler")


@pytest.mark.slow
def test_the_launcher_says_what_the_trainer_filled_in_and_counts_its_own_steps(hf_workdir: Path) -> None:
    """The Trainer drives its own loop (--max_steps 4): no "4/100 steps" (the recipe's default train.steps,
    which read as a job stopped early) but "4 steps", or "4/4" where its config's scheduler carries a total
    the Trainer fills in. Its "auto" keys are one line at launch, their values one line at initialize."""
    stage_run(hf_workdir, 2)
    hf_runs.zerorun(hf_workdir, "auto", HERE / "configs" / "hf_auto_stage2.json", *DS_OPTIMIZER)
    plain, auto = ((hf_workdir / f"{name}.log").read_text() for name in ("stage2", "auto"))
    assert ": 4 steps in " in plain and "/100" not in plain, plain[-3000:]
    assert ": 4/4 steps in " in auto, auto[-3000:]  # WarmupDecayLR's total_num_steps: "auto", filled with 4
    assert "zerorun's default for" not in auto and "(an HF Trainer placeholder)" not in auto
    assert sum(line.startswith("zerorun: warning:") for line in auto.splitlines()) == 0, auto[:3000]
    assert 'hf_auto_stage2.json: "auto" in 13 keys (' in auto  # one line at launch
    filled = next(line for line in auto.splitlines() if 'the script filled in the "auto" keys of' in line)
    assert "optimizer.params.lr 0.001" in filled and "scheduler.params.total_num_steps 4" in filled, filled


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adafactor", "sgd"])
def test_trainer_with_optim_adafactor_or_sgd_under_deepspeed_trains_as_ddp(hf_workdir: Path, optim: str) -> None:
    """`--optim adafactor` (transformers' Adafactor: zerorun does not know the class, so it runs on whole parameters,
    one owner each) and `--optim sgd` (torch's SGD: elementwise, over the flat shard), handed to DeepSpeed as the
    client optimizer: the same losses as DDP with the same --optim."""
    args = [*HF_OPTIMIZER, "--optim", optim]
    reference = hf_runs.ddp(hf_workdir, f"ddp_{optim}", *args)
    ours = hf_runs.zerorun(hf_workdir, f"stage2_{optim}", hf_runs.stage_config(hf_workdir, 2), *args)
    assert_close(ours, reference, f"--optim {optim} stage 2")
