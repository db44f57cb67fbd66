"""`zerorun convert` on realistic DeepSpeed configs writes recipes that launch; refused keys are named.

The configs in configs/ follow DeepSpeed's documented examples and common HF Trainer and Megatron
ones: ZeRO-2 with CPU offload and fp16, ZeRO-3 with NVMe offload and bf16, a Megatron GPT-2 ZeRO-1
config with OneCycle, an HF Trainer config full of "auto", and a BERT config with Lamb's trust ratio clamped
otherwise than zerorun's Lamb and sparse attention (refused).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.launch.launched import subprocess_env
from zerorun import config
from zerorun.cli import app

HERE = Path(__file__).parent
CONFIGS = HERE / "configs"
SCRIPT = HERE / "scripts" / "ds_train.py"


def _convert(tmp_path: Path, name: str, *flags: str) -> tuple[Path, object]:
    out = tmp_path / f"{name}.yaml"
    result = CliRunner().invoke(app, ["convert", str(CONFIGS / f"{name}.json"), "--out", str(out),
                                      "--script", str(SCRIPT), *flags])
    return out, result


def test_zero2_offload_fp16_converts_key_by_key_with_comments(tmp_path: Path) -> None:
    out, result = _convert(tmp_path, "zero2_offload_fp16")
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert "offload_optimizer:\n    device: \"cpu\"   # zero_optimization.offload_optimizer.device" in text
    assert "#   zero_optimization.contiguous_gradients: info:" in text
    recipe = config.load(out)
    assert Path(recipe.script).resolve() == SCRIPT and recipe.launch.deepspeed_compat
    assert (recipe.zero.stage, recipe.zero.offload_optimizer.device, recipe.precision.dtype) == (2, "cpu", "fp16")
    assert (recipe.precision.initial_loss_scale, recipe.precision.hysteresis) == (4096.0, 2)
    assert (recipe.optimizer.type, recipe.optimizer.weight_decay) == ("adamw", 3e-7)
    assert (recipe.scheduler.type, recipe.scheduler.total_num_steps, recipe.scheduler.warmup_max_lr) == \
        ("WarmupDecayLR", 100, 3e-4)
    assert (recipe.train.micro_batch_size, recipe.train.grad_accum_steps, recipe.train.clip_grad_norm) == (4, 2, 1.0)


def test_a_train_batch_size_needs_the_world_size_to_convert(tmp_path: Path) -> None:
    _, result = _convert(tmp_path, "megatron_gpt2_zero1")
    assert result.exit_code == 2 and "pass --world-size N" in result.stderr
    out, result = _convert(tmp_path, "megatron_gpt2_zero1", "--world-size", "2")
    assert result.exit_code == 0, result.output
    recipe = config.load(out)
    assert (recipe.train.micro_batch_size, recipe.train.grad_accum_steps, recipe.train.global_batch_size) == (4, 2, 16)
    assert "zerorun: warning:" in result.stderr and "tensorboard: ignored" in result.stderr
    assert "activation_checkpointing: ignored" in result.stderr


def test_a_complete_batch_triple_converts_without_the_world_size_and_is_checked_at_launch(tmp_path: Path) -> None:
    ds = tmp_path / "triple.json"
    ds.write_text('{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}')
    out = tmp_path / "triple.yaml"
    result = CliRunner().invoke(app, ["convert", str(ds), "--out", str(out), "--script", str(SCRIPT)])
    assert result.exit_code == 0, result.output
    recipe = config.load(out)
    assert (recipe.train.micro_batch_size, recipe.train.grad_accum_steps, recipe.train.global_batch_size) == (8, 2, 32)
    with pytest.raises(config.ConfigError, match="world size 3"):
        config.check_global_batch(recipe, 3)
    config.check_global_batch(recipe, 2)


def test_unsupported_keys_are_refused_by_name_with_what_zerorun_does_instead(tmp_path: Path) -> None:
    _, result = _convert(tmp_path, "bing_bert_lamb", "--world-size", "64")
    assert result.exit_code == 2
    for key in ("optimizer.params.max_coeff: not supported", "optimizer.params.bias_correction: not supported",
                "sparse_attention"):
        assert key in result.stderr, (key, result.stderr)
    assert "Traceback" not in result.output


def _launch(recipe: Path, cwd: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "zerorun.cli", "launch", str(recipe), *flags]
    return subprocess.run(argv, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name, world_size, extra", [
    ("zero2_offload_fp16", None, []),
    ("megatron_gpt2_zero1", "2", []),
    ("hf_trainer_zero2", None, []),
    ("zero3_nvme", "2", ["nvme"]),
])
@pytest.mark.slow
def test_converted_realistic_configs_launch_on_2_cpu_workers(tmp_path: Path, name: str, world_size: str | None,
                                                             extra: list[str], request: pytest.FixtureRequest) -> None:
    out, result = _convert(tmp_path, name, *(["--world-size", world_size] if world_size else []))
    assert result.exit_code == 0, result.output
    flags = ["--num_gpus", "2", "--set", f"args=[--steps, '2', --out, {tmp_path / 'run'}]"]
    if "nvme" in extra:
        nvme = request.getfixturevalue("direct_io_dir")
        flags += ["--set", f"zero.offload_optimizer.nvme_path={nvme}", "--set", f"zero.offload_param.nvme_path={nvme}"]
    launched = _launch(out, tmp_path, *flags)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    assert (tmp_path / "run.rank0.json").is_file() and (tmp_path / "run.rank1.json").is_file()


def test_a_py_launch_with_an_unsupported_config_is_refused_before_anything_starts(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "zerorun.cli", "launch", "--num_gpus", "2", str(SCRIPT), "--deepspeed",
            "--deepspeed_config", str(CONFIGS / "bing_bert_lamb.json"), "--out", "x"]
    result = subprocess.run(argv, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "optimizer.params.max_coeff: not supported" in result.stderr
    assert "zerorun: job" not in result.stderr  # nothing was started


def test_a_train_batch_size_that_does_not_split_over_the_workers_is_refused_at_launch(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, '
                  '"optimizer": {"type": "AdamW", "params": {}}}')
    argv = [sys.executable, "-m", "zerorun.cli", "launch", "--num_gpus", "2", "--dry-run", str(SCRIPT),
            "--deepspeed_config", str(ds), "--out", "x"]
    result = subprocess.run(argv, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "train_batch_size 12 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 1 x world " \
           "size 2" in result.stderr
