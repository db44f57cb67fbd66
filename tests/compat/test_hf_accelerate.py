"""An unchanged accelerate script with a DeepSpeed plugin trains under `zerorun launch` as accelerate's DDP.

`scripts/accelerate_train.py` builds `Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, ...))`
and calls prepare, accumulate, backward, clip_grad_norm_, save_state and load_state. Reference: the
same script without the plugin (`Accelerator(cpu=True)`, gloo DDP) under torchrun. Both on 2 ranks with
accumulation 2, clipping, a torch AdamW and a LambdaLR that accelerate steps itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from tests.launch.launched import subprocess_env  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_train.py"
WORLD = 2
LOSS_RTOL = 1e-5  # measured: equal to the bit (two fp32 ranks sum the same way as DDP's all-reduce)


def _run(argv: list[str], cwd: Path) -> None:
    env = subprocess_env()
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _losses(prefix: Path) -> list[list[float]]:
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text())["losses"] for r in range(WORLD)]


@pytest.mark.slow
def test_accelerate_script_with_a_deepspeed_plugin_trains_as_ddp_and_resumes_exactly(tmp_path: Path) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), str(SCRIPT),
          "--record", str(tmp_path / "ddp")], tmp_path)
    launch = [sys.executable, "-m", "zerorun.cli", "launch", "--num_gpus", str(WORLD), str(SCRIPT), "--zero_stage",
              "2", "--ckpt", str(tmp_path / "state")]
    _run([*launch, "--record", str(tmp_path / "zero2")], tmp_path)
    _run([*launch, "--record", str(tmp_path / "resumed"), "--resume"], tmp_path)
    for ours, reference, resumed in zip(_losses(tmp_path / "zero2"), _losses(tmp_path / "ddp"),
                                        _losses(tmp_path / "resumed")):
        got, want = torch.tensor(ours), torch.tensor(reference)
        assert got.shape == want.shape == (8,)
        assert ((got - want).abs() / want.abs()).max().item() <= LOSS_RTOL
        assert resumed == ours[4:]  # save_state after 2 updates, load_state: bit for bit
