"""`--bf16` with the config's `bf16.enabled: "auto"`: the Trainer script trains bf16 under zerorun on CPU ranks.

transformers refuses `--bf16` without a bf16 GPU unless `--use_cpu`, which turns DeepSpeed off;
under `zerorun launch` its check answers yes on a machine without CUDA (`zerorun.compat.hf_cpu`),
transformers fills `bf16.enabled: true`, and zerorun's engine trains bf16 parameters and
activations with fp32 master weights, gradient sums and Adam moments.

Reference: the same script under torchrun with `--use_cpu --bf16`, accelerate's DDP with torch
autocast (fp32 parameters, bf16 matmuls). The two round at different places: autocast keeps
layer norms, softmax, GELU and the residual stream in fp32, zerorun's bf16 model computes them
in bf16; both compute from the same bf16-rounded weights, and the loss (computed from bf16
logits upcast to fp32) is defined only to about bf16's unit roundoff u = 2^-8 relative: the
bound. Measured 2.8e-5 (errors of many elements average out); the fp32 run lies 1.9e-5 from the
autocast run, so losses cannot tell bf16 from fp32 here: the parameter dtypes the script records
do (bf16 under zerorun, fp32 under autocast).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.compat import hf_runs
from tests.compat.hf_runs import HF_OPTIMIZER, assert_close

BF16_UNIT_ROUNDOFF = 2.0**-8


@pytest.mark.slow
def test_bf16_flag_trains_a_bf16_model_under_zerorun_as_ddp_with_autocast(hf_workdir: Path) -> None:
    reference = hf_runs.ddp(hf_workdir, "ddp_bf16", *HF_OPTIMIZER, "--bf16")
    ours = hf_runs.zerorun(hf_workdir, "stage2_bf16", hf_runs.stage_config(hf_workdir, 2), *HF_OPTIMIZER, "--bf16")
    assert_close(ours, reference, "bf16", rtol=BF16_UNIT_ROUNDOFF)
    assert [r["param_dtypes"] for r in ours] == [["torch.bfloat16"]] * 2  # zerorun's engine computes in bf16
    assert [r["param_dtypes"] for r in reference] == [["torch.float32"]] * 2  # autocast: fp32 parameters
    assert ours[0]["lrs"] == reference[0]["lrs"]
