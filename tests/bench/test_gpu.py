"""`zerorun bench gpu` stays runnable without a GPU, and its numerics check can fail.

The CUDA steps need a GPU (they run on a GPU machine: docs/gpu.md); here the command must skip
them cleanly, and the numerics check, run on the CPU kernel, must pass on the real kernel and fail
on one that is off by a little.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from zerorun import ops
from zerorun.bench import gpu, gpu_kernel
from zerorun.cli import app

SMALL = 70_000  # the cases up to 65539 elements: a second on a CPU


def test_without_cuda_every_step_after_the_environment_skips_and_the_exit_code_is_0(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the command runs for real there")
    import time

    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "bench", "gpu", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("SKIP environment: no CUDA device: torch ") and ", commit " in lines[0]
    assert [line.split(":")[0] for line in lines[1:len(gpu.STEPS)]] == [f"SKIP {s}" for s in gpu.STEPS[1:]]
    assert lines[-2].startswith("zerorun bench gpu: PASS 0, FAIL 0, SKIP 9 in ")
    said = float(lines[-2].rsplit(" in ", 1)[1].removesuffix(" s"))  # issue 57: "in 0 s" for a 14.8 s run
    assert 0.5 * wall <= said <= wall, (said, wall)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["step"] for s in report["steps"]] == list(gpu.STEPS) and report["commit"]


def test_unknown_step_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "gpu", "--steps", "numerix"])
    assert result.exit_code == 2 and "--steps: unknown numerix" in result.stderr, result.output


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
    assert {r.status for r in gpu.launches(tmp_path, 10)} == {gpu.Status.SKIP}


def test_the_launches_cover_nccl_at_stages_2_and_3_and_gloo_ranks_sharing_the_gpu_at_every_stage() -> None:
    sets = {(launch.ranks, frozenset(launch.overrides)) for launch in gpu.LAUNCHES}
    for stage in (2, 3):
        assert (1, frozenset({"launch.backend=nccl", "precision=bf16", f"zero.stage={stage}"})) in sets
        offloaded = [o for r, o in sets if r == 1 and f"zero.stage={stage}" in o and "zero.offload_optimizer=cpu" in o]
        assert offloaded, f"no offloaded NCCL launch at stage {stage}"
    for ranks in (2, 3):
        for stage in range(4):
            assert (ranks, frozenset({"launch.backend=gloo", f"zero.stage={stage}"})) in sets
    assert "zero.overlap_publish=true" in gpu.SANITIZED_LAUNCH.overrides


def test_a_failing_test_is_named_with_its_message(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_gpu_thing.py").write_text(textwrap.dedent("""
        def test_fine():
            pass

        def test_broken():
            assert 1 == 2, "the kernel wrote the wrong bits"
    """))
    result = gpu.pytest(tmp_path, 60, ("tests/test_gpu_thing.py",))
    assert result.status is gpu.Status.FAIL
    assert result.detail.startswith("1 passed, 1 failed; FAILED tests/test_gpu_thing.py::test_broken: ")
    assert "the kernel wrote the wrong bits" in result.detail


def test_a_sanitizer_report_fails_the_step() -> None:
    report = "============================\nCSAN detected a possible data race on tensor with data pointer 0x7f"
    assert gpu._sanitizer_reports(report) == ["CSAN detected a possible data race on tensor with data pointer 0x7f"]
    assert gpu._sanitizer_reports("step 3 loss 1.23\ndone: 8 steps") == []


def test_without_deepspeed_the_side_by_side_skips_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda name: None)
    result = gpu.deepspeed_offload(Path("."), 10)
    assert result.status is gpu.Status.SKIP and "deepspeed does not import here" in result.detail


@pytest.mark.slow
def test_a_launch_runs_the_quick_start_shortened(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch step's command line, its loss parsing and its checks, on CPU ranks (gloo)."""
    root = Path(__file__).parents[2]
    result = gpu.launch(root, gpu.Launch("2 CPU ranks, stage 2", 2, ("launch.backend=gloo", "zero.stage=2")), 180)
    assert result.status is gpu.Status.PASS, result.detail
    assert re.fullmatch(r"loss [\d.]+ -> [\d.]+", result.detail), result.detail
