"""The Hugging Face Trainer runs the compat tests compare, each launched once per session and shared.

`scripts/hf_train.py` is a plain Trainer script (HfArgumentParser + TrainingArguments) loading a tiny
GPT-2 (tied embedding, dropout off) from a `save_pretrained` directory written once per session.
A run is named by what it is (`ddp_hf`, `stage2`, ...) and launched the first time a test asks
for it; the next test that needs it reads its records (`<name>.rank<r>.json`: every micro-step's
loss, the learning rates, the parameter dtypes, which `deepspeed` served). Launches, not tests,
are what cost time here (each rank imports transformers), so tests share them.

Dropout is off so that a run on another number of ranks sees the same model function (per-rank
random streams cannot carry over to a different world size); the parity runs do not need it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.launch.launched import subprocess_env

HERE = Path(__file__).parent
SCRIPT = HERE / "scripts" / "hf_train.py"
REAL_DEEPSPEED = HERE / "scripts" / "real_deepspeed_cpu.py"
WORLD = 2
LOSS_RTOL = 1e-5  # fp32: measured <= 1.2e-7; a one-step schedule shift or a missed clip moves losses by >1e-4
# 2 ranks x micro-batch 3 x accumulation 2: a global batch of 12 samples, which 3 ranks x micro-batch 2 keep
TRAINING = ["--max_steps", "4", "--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "2",
            "--learning_rate", "1e-3", "--max_grad_norm", "0.5", "--warmup_steps", "2", "--save_strategy", "no",
            "--report_to", "none", "--seed", "0", "--disable_tqdm", "true", "--optim", "adamw_torch",
            "--logging_steps", "1"]
HF_OPTIMIZER = ["--weight_decay", "0.1"]
DS_OPTIMIZER = ["--weight_decay", "0.0"]  # the config's AdamW decays every parameter; the Trainer's skips some
# a run takes 7-9 s quiet on 2 cores (3 ranks or real DeepSpeed up to ~20 s), a few times that beside the suite's
# other worker; a hang (gloo's, once in a plain-torchrun run) costs this, not CI's whole budget
RUN_TIMEOUT_S = 120
SAVE_AT_2 = ["--save_strategy", "steps", "--save_steps", "2"]  # argparse: the last --save_strategy wins


def write_model(tmp: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(tmp / "model")  # tied lm_head: one weight in the file


def stage_config(tmp: Path, stage: int, **extra: object) -> Path:
    """A DeepSpeed config as Trainer users write it: batch, clipping and bf16 "auto"."""
    path = tmp / f"ds_stage{stage}.json"
    zero: dict = {"stage": stage}
    if stage == 3:  # trainer.save_model() then writes the consolidated weights (DeepSpeed's default: false)
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "train_batch_size": "auto", "gradient_clipping": "auto",
                                "bf16": {"enabled": "auto"}, "zero_optimization": zero, **extra}))
    return path


def run(argv: list[str], cwd: Path, **env: str) -> str:
    """Run a launch to its end; one still running after RUN_TIMEOUT_S is stopped (SIGTERM: torchrun and zerorun
    both stop their ranks) and fails its test, not the whole suite's time."""
    environment = {**subprocess_env(), "OMP_NUM_THREADS": "1", **env}
    with subprocess.Popen(argv, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise AssertionError(f"still running after {RUN_TIMEOUT_S} s, stopped: {' '.join(argv)}\n"
                                 + out[-4000:] + err[-4000:]) from None
    assert proc.returncode == 0, out[-4000:] + err[-4000:]
    return out + err


def records(prefix: Path, world: int = WORLD) -> list[dict]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(world)]


def _script_args(tmp: Path, name: str, args: list[str]) -> list[str]:
    return [str(SCRIPT), "--model_dir", str(tmp / "model"), "--record", str(tmp / name),
            "--output_dir", str(tmp / f"out_{name}"), *TRAINING, *args]


def _once(tmp: Path, name: str, world: int, argv: list[str], **env: str) -> list[dict]:
    if not Path(f"{tmp / name}.rank0.json").exists():
        (tmp / f"{name}.log").write_text(run(argv, tmp, **env))
    return records(tmp / name, world)


def ddp(tmp: Path, name: str, *args: str) -> list[dict]:
    """The script without --deepspeed under torchrun with --use_cpu: accelerate's DDP on gloo."""
    return _once(tmp, name, WORLD, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                                    *_script_args(tmp, name, list(args)), "--use_cpu"])


def zerorun(tmp: Path, name: str, ds: Path, *args: str, world: int = WORLD) -> list[dict]:
    """`zerorun launch --num_gpus <world> hf_train.py ... --deepspeed ds.json`."""
    more = ["--set", "launch.oversubscribe=true"] if world > WORLD else []  # 3 ranks on a 2-core machine: meant
    return _once(tmp, name, world, [sys.executable, "-m", "zerorun.cli", "launch", "--num_gpus", str(world), *more,
                                    *_script_args(tmp, name, list(args)), "--deepspeed", str(ds)])


def real_deepspeed(tmp: Path, name: str, python: str, ds: Path, *args: str) -> list[dict]:
    """The same command line under torchrun with the real DeepSpeed (CPU accelerator), zerorun not launching."""
    return _once(tmp, name, WORLD, [python, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
                                    str(REAL_DEEPSPEED), *_script_args(tmp, name, list(args)), "--deepspeed",
                                    str(ds)], DS_ACCELERATOR="cpu")


def stage_run(tmp: Path, stage: int) -> list[dict]:
    """zerorun at `stage` with the Trainer's own AdamW and schedule; stage 3 also saves at update 2."""
    return zerorun(tmp, f"stage{stage}", stage_config(tmp, stage), *HF_OPTIMIZER, *(SAVE_AT_2 if stage == 3 else []))


def assert_close(ours: list[dict], reference: list[dict], what: str, rtol: float = LOSS_RTOL) -> None:
    for rank, (got, want) in enumerate(zip(ours, reference)):
        a, b = torch.tensor(got["losses"]), torch.tensor(want["losses"])
        assert a.shape == b.shape == (8,), (what, a.shape, b.shape)
        worst = ((a - b).abs() / b.abs()).max().item()
        assert worst <= rtol, f"{what} rank {rank}: losses differ by {worst:.2e} relative (allowed {rtol:.1e})"
        assert got["global_step"] == 4


def assert_same_saved_model(ours: Path, reference: Path) -> None:
    """`ours` is a Hugging Face model directory from_pretrained loads in a plain process, with `reference`'s
    weights (fp32 summation order apart: measured 1.1e-7 at most)."""
    from transformers import AutoModelForCausalLM

    assert (ours / "config.json").is_file() and (ours / "model.safetensors").is_file()
    got = AutoModelForCausalLM.from_pretrained(ours).state_dict()
    want = AutoModelForCausalLM.from_pretrained(reference).state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="session")
def hf_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's model directory and runs (skipped without transformers and accelerate)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    tmp = tmp_path_factory.mktemp("hf")
    write_model(tmp)
    return tmp

