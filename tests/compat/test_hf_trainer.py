"""An unchanged Hugging Face Trainer script trains under `zerorun launch ... --deepspeed ds.json` as under DDP.

`scripts/hf_train.py` is a plain Trainer script (HfArgumentParser + TrainingArguments) loading a tiny
GPT-2 from a `save_pretrained` directory this module writes. Reference: the same script without
`--deepspeed` under torchrun with `--use_cpu` (accelerate's CPU DDP, gloo), 2 ranks. zerorun runs it
with `zerorun launch --num_gpus 2 hf_train.py ... --deepspeed ds.json` at ZeRO stages 1, 2 and 3 with
accumulation 2, clipping that bites, and the Trainer's own AdamW (two param groups: no decay for
biases and norms) and linear warmup schedule; and once with the DeepSpeed config's optimizer and
scheduler sections set to "auto" (filled by transformers), against the DDP script following
DeepSpeed's WarmupDecayLR. fp32 losses of every micro-step on every rank agree within 1e-5
relative (measured: <= 1.2e-7, fp32 summation order). Stage 3 loads the pretrained weights through
`deepspeed.zero.Init` and `GatheredParameters`, with GPT-2's tied embedding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.launch.launched import subprocess_env  # noqa: E402

HERE = Path(__file__).parent
SCRIPT = HERE / "scripts" / "hf_train.py"
WORLD = 2
LOSS_RTOL = 1e-5  # measured <= 1.2e-7; a one-step schedule shift or a missed clip moves losses by >1e-4
TRAINING = ["--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--learning_rate", "1e-3", "--max_grad_norm", "0.5", "--warmup_steps", "2", "--save_strategy", "no",
            "--report_to", "none", "--seed", "0", "--disable_tqdm", "true", "--optim", "adamw_torch",
            "--logging_steps", "1"]
HF_OPTIMIZER = ["--weight_decay", "0.1"]
DS_OPTIMIZER = ["--weight_decay", "0.0"]  # the config's AdamW decays every parameter; the Trainer's skips some


def _stage_config(tmp: Path, stage: int) -> Path:
    path = tmp / f"ds_stage{stage}.json"
    zero: dict = {"stage": stage}
    if stage == 3:  # trainer.save_model() then writes the consolidated weights (DeepSpeed's default: false)
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "train_batch_size": "auto", "gradient_clipping": "auto",
                                "bf16": {"enabled": "auto"}, "zero_optimization": zero}))
    return path


def _run(argv: list[str], cwd: Path) -> str:
    env = subprocess_env()
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout + result.stderr


def _records(prefix: Path, world: int = WORLD) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp / "model")  # tied lm_head: one weight in the file
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, name, 0.0)  # a run on other ranks draws other dropout masks
    GPT2LMHeadModel(config).save_pretrained(tmp / "model_no_dropout")
    return tmp


def _script_args(tmp: Path, name: str, optimizer: list[str], model: str = "model") -> list[str]:
    return [str(SCRIPT), "--model_dir", str(tmp / model), "--record", str(tmp / name),
            "--output_dir", str(tmp / f"out_{name}"), *TRAINING, *optimizer]


def _ddp(tmp: Path, name: str, *extra: str) -> list[dict]:
    if not Path(f"{tmp / name}.rank0.json").exists():
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
              *_script_args(tmp, name, list(extra)), "--use_cpu"], tmp)
    return _records(tmp / name)


def _zerorun(tmp: Path, name: str, ds: Path, optimizer: list[str], *extra: str, world: int = WORLD,
             model: str = "model") -> list[dict]:
    output = _run([sys.executable, "-m", "zerorun.cli", "launch", "--num_gpus", str(world),
                   *_script_args(tmp, name, optimizer, model), "--deepspeed", str(ds), *extra], tmp)
    (tmp / f"{name}.log").write_text(output)
    return _records(tmp / name, world)


SAVE_AT_2 = ("--save_strategy", "steps", "--save_steps", "2")  # argparse: the last --save_strategy wins


def _assert_close(ours: list[dict], reference: list[dict], what: str) -> None:
    for rank, (got, want) in enumerate(zip(ours, reference)):
        a, b = torch.tensor(got["losses"]), torch.tensor(want["losses"])
        assert a.shape == b.shape == (8,), (what, a.shape, b.shape)
        worst = ((a - b).abs() / b.abs()).max().item()
        assert worst <= LOSS_RTOL, f"{what} rank {rank}: losses differ by {worst:.2e} relative"
        assert got["global_step"] == 4


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_script_with_its_own_optimizer_trains_as_ddp(workdir: Path, stage: int) -> None:
    reference = _ddp(workdir, "ddp_hf", *HF_OPTIMIZER)
    ours = _zerorun(workdir, f"stage{stage}", _stage_config(workdir, stage), HF_OPTIMIZER,
                    *(SAVE_AT_2 if stage == 3 else ()))
    _assert_close(ours, reference, f"stage {stage}")
    assert ours[0]["lrs"] == reference[0]["lrs"] == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])
    if stage == 3:
        assert "stage 3 units: GPT2Block" in (workdir / "stage3.log").read_text()  # _no_split_modules
        model_bytes = sum(t.numel() * 4 for t in _pretrained(workdir).values())
        for rank, record in enumerate(ours):  # loading never held the whole model on a rank
            assert 0 < record["staged_peak_bytes"] < 0.75 * model_bytes, (rank, record["staged_peak_bytes"])
        _assert_same_saved_model(workdir / "out_stage3" / "final", workdir / "out_ddp_hf" / "final")


def _assert_same_saved_model(ours: Path, reference: Path) -> None:
    """trainer.save_model() wrote a Hugging Face model directory that from_pretrained loads here, in a plain
    process, with the DDP run's weights (measured: 1.1e-7 apart at most, fp32 summation order)."""
    from transformers import AutoModelForCausalLM

    assert (ours / "config.json").is_file() and (ours / "model.safetensors").is_file()
    got = AutoModelForCausalLM.from_pretrained(ours).state_dict()
    want = AutoModelForCausalLM.from_pretrained(reference).state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def _pretrained(tmp: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(tmp / "model" / "model.safetensors")


def test_trainer_resumes_from_its_checkpoint_exactly(workdir: Path) -> None:
    """trainer.train(resume_from_checkpoint=...) on the stage 3 run's step-2 checkpoint: the losses after it
    equal the uninterrupted run's bit for bit (weights, Adam moments, schedule, data position, RNG)."""
    full = workdir / "stage3.rank0.json"
    if not full.exists():
        pytest.skip("needs the stage 3 run of test_trainer_script_with_its_own_optimizer_trains_as_ddp")
    checkpoint = workdir / "out_stage3" / "checkpoint-2"
    resumed = _zerorun(workdir, "resumed", _stage_config(workdir, 3), HF_OPTIMIZER,
                       "--resume_from_checkpoint", str(checkpoint))
    for uninterrupted, after in zip(_records(workdir / "stage3"), resumed):
        assert after["losses"] == uninterrupted["losses"][4:]


def _step_losses(records: list[dict], accum: int = 2) -> list[float]:
    """Each update's loss over its whole global batch. The Trainer's micro-step loss is the micro-batch's token
    loss sum over the tokens of the global batch, times the world size (average_tokens_across_devices): summed
    over every rank's micro-steps of an update and divided by the world size, the batch's mean token loss."""
    world = len(records)
    steps = len(records[0]["losses"]) // accum
    return [sum(sum(r["losses"][s * accum:(s + 1) * accum]) for r in records) / world for s in range(steps)]


def test_trainer_resumes_on_three_ranks_from_a_checkpoint_saved_on_two(workdir: Path) -> None:
    """2 ranks x micro-batch 3 save at update 2; 3 ranks x micro-batch 2 resume from it: the global batch (12
    samples, accumulation 2) and its samples are the same, so updates 3 and 4 see the same data as in the
    uninterrupted 2-rank run, and their mean losses and the final weights equal its own (fp32 summation order
    apart). Dropout is off: per-rank random streams cannot carry over to another number of ranks."""
    ds, two, three = _stage_config(workdir, 3), "w2", "w3_resumed"
    uninterrupted = _zerorun(workdir, two, ds, HF_OPTIMIZER, "--per_device_train_batch_size", "3", *SAVE_AT_2,
                             model="model_no_dropout")
    resumed = _zerorun(workdir, three, ds, HF_OPTIMIZER, "--per_device_train_batch_size", "2",
                       "--resume_from_checkpoint", str(workdir / f"out_{two}" / "checkpoint-2"), world=3,
                       model="model_no_dropout")
    assert [r["global_step"] for r in resumed] == [4, 4, 4]
    got, want = torch.tensor(_step_losses(resumed)), torch.tensor(_step_losses(uninterrupted)[2:])
    assert got.shape == want.shape == (2,)
    worst = ((got - want).abs() / want.abs()).max().item()
    assert worst <= LOSS_RTOL, f"losses after the resume differ by {worst:.2e} relative: {got} vs {want}"
    _assert_same_saved_model(workdir / f"out_{three}" / "final", workdir / f"out_{two}" / "final")


def test_consolidate_format_hf_writes_what_from_pretrained_loads(workdir: Path) -> None:
    """`zerorun checkpoint consolidate --format hf` on the Trainer's step-2 checkpoint (zerorun's sharded
    one inside it), sharded small: from_pretrained reads the Trainer's own save_model of that step."""
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from zerorun.cli import app

    checkpoint = workdir / "out_stage3" / "checkpoint-2"
    if not checkpoint.exists():
        pytest.skip("needs the stage 3 run of test_trainer_script_with_its_own_optimizer_trains_as_ddp")
    out = workdir / "consolidated"
    result = CliRunner().invoke(app, ["checkpoint", "consolidate", str(checkpoint), "--format", "hf", "--out",
                                      str(out), "--max-shard-mb", "0.05"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()  # the Trainer's consolidated save
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_trainer_script_with_the_configs_auto_optimizer_and_scheduler_trains_as_ddp(workdir: Path) -> None:
    reference = _ddp(workdir, "ddp_ds_schedule", *DS_OPTIMIZER, "--ds_schedule")
    ours = _zerorun(workdir, "auto", HERE / "configs" / "hf_auto_stage2.json", DS_OPTIMIZER)
    _assert_close(ours, reference, "auto optimizer and scheduler")
