"""`zerorun bench gpu` stays runnable without a GPU, and its numerics check can fail.

The CUDA steps need a GPU (they run on a GPU machine: docs/gpu.md); here the command must skip
them cleanly, and the numerics check, run on the CPU kernel, must pass on the real kernel and fail
on one that is off by a little.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from zerorun import ops
from zerorun.bench import gpu, gpu_kernel

SMALL = 70_000  # the cases up to 65539 elements: a second on a CPU


def test_without_cuda_every_step_after_the_environment_skips_and_the_exit_code_is_0() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the command runs for real there")
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "bench", "gpu"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("SKIP environment: no CUDA device: torch ")
    assert [line.split(":")[0] for line in lines[1:6]] == [f"SKIP {s}" for s in gpu.STEPS[1:]]
    assert lines[-1] == "zerorun bench gpu: PASS 0, FAIL 0, SKIP 6"


def test_unknown_step_is_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "bench", "gpu", "--steps", "numerix"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--steps: unknown numerix" in result.stderr


def _cpu_kernel() -> None:
    if not ops.build(["cpu_adam"])["cpu_adam"].startswith("loaded"):
        pytest.skip("the CPU Adam kernel does not build here")


def test_numerics_pass_on_the_real_kernel() -> None:
    _cpu_kernel()
    results = gpu.numerics(torch.device("cpu"), SMALL)
    assert results.status is gpu.Status.PASS, results.detail
    assert results.detail.startswith("16/16 cases")  # sizes 1 to 65539, aligned and not


def test_numerics_fail_on_a_kernel_off_by_one_part_in_a_million(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu_kernel()
    real = ops.adamw_step

    def off(params: torch.Tensor, *args: object, **kwargs: object) -> None:
        real(params, *args, **kwargs)
        params.mul_(1 + 3e-6)  # what a wrong rounding of a hyper-parameter looks like after a step

    monkeypatch.setattr(gpu_kernel.ops, "adamw_step", off)
    results = gpu.numerics(torch.device("cpu"), SMALL)
    assert results.status is gpu.Status.FAIL and "first failure" in results.detail, results.detail


def test_a_missing_checkout_skips_the_tests_and_launches(tmp_path) -> None:
    assert gpu.pytest(tmp_path, 10).status is gpu.Status.SKIP
    assert [r.status for r in gpu.launches(tmp_path, 10)] == [gpu.Status.SKIP]
