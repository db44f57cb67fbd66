"""`zerorun bench gpu`: everything that needs a GPU, checked in one command on a new GPU machine.

CI has no GPU, so the CUDA paths are written to run their logic on the CPU too; this command runs
what only a GPU can: the environment (torch's CUDA build, nvcc, CUDA_HOME), the build of the CUDA
Adam kernel, its numerics and bandwidth (`bench/gpu_kernel.py`), the CUDA tests of a checkout, and
the quick start on one GPU at stages 2 and 3. Each step says PASS, FAIL or SKIP with its reason;
without CUDA every step after the environment skips, so the command stays runnable anywhere.
"""

from __future__ import annotations

import enum
import json
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from zerorun import ops
from zerorun.bench import gpu_kernel

STEPS = ("environment", "build", "numerics", "bandwidth", "pytest", "launch")
CUDA_TESTS = ("tests/test_kernels_cuda.py", "tests/runtime/test_cuda_parity.py")
LAUNCHES = {  # the quick start on one GPU: name -> --set overrides
    "stage 2, bf16": ["zero.stage=2", "precision=bf16"],
    "stage 3, bf16": ["zero.stage=3", "precision=bf16"],
    "stage 3, bf16, optimizer on the CPU": ["zero.stage=3", "precision=bf16", "zero.offload_optimizer=cpu"],
}
BANDWIDTH_FLOOR = 0.7  # of a device-to-device copy: the update is memory-bound, so less is a slow kernel


class Status(enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class StepResult:
    step: str
    status: Status
    detail: str


@dataclass(frozen=True)
class Options:
    steps: tuple[str, ...] = STEPS
    root: Path = Path(".")  # a checkout: where tests/ and recipes/ are
    max_numel: int = 10**12
    timeout_s: float = 300.0  # per subprocess (the tests, each launch)


def environment() -> StepResult:
    cuda = torch.version.cuda
    home = ops._cuda_home() if cuda else None
    line = f"torch {torch.__version__}, CUDA build {cuda or 'none'}, CUDA_HOME {home or 'none'}"
    if not torch.cuda.is_available():
        return StepResult("environment", Status.SKIP, f"no CUDA device: {line}")
    return StepResult("environment", Status.PASS, f"{torch.cuda.get_device_name(0)}; {line}")


def build() -> StepResult:
    lines = ops.build(["fused_adam", "cpu_adam"])
    bad = {k: line for k, line in lines.items() if not line.startswith("loaded")}
    detail = "; ".join(f"{k}: {line}" for k, line in (bad or lines).items())
    return StepResult("build", Status.FAIL if bad else Status.PASS, detail)


def numerics(device: torch.device, max_numel: int) -> StepResult:
    results = gpu_kernel.numerics(device, max_numel)
    failed = [r for r in results if not r.ok]
    worst = max(results, key=lambda r: r.vs_cpu_fused / r.tolerance)
    detail = (f"{len(results) - len(failed)}/{len(results)} cases; worst against torch's CPU fused AdamW "
              f"{worst.vs_cpu_fused:.1e} of |p| (tolerance {worst.tolerance:.0e}), moments {worst.moments_rel:.1e}")
    if failed:
        first = failed[0]
        detail += (f"; first failure: {first.case.name}, n={first.case.numel}: parameters {first.vs_cpu_fused:.1e} "
                   f"(float64 {first.vs_float64:.1e}), moments {first.moments_rel:.1e}, copy exact {first.copy_exact}")
    return StepResult("numerics", Status.FAIL if failed else Status.PASS, detail)


def bandwidth() -> StepResult:
    rates = gpu_kernel.bandwidth()
    copy = rates["device-to-device copy"]
    ours, theirs = rates["zerorun"], rates["torch AdamW(fused=True)"]
    detail = ", ".join(f"{name} {gbps:.0f} GB/s" for name, gbps in rates.items())
    detail += f"; ours {ours / copy:.0%} of the copy, {ours / theirs:.2f}x torch's fused AdamW"
    return StepResult("bandwidth", Status.PASS if ours >= BANDWIDTH_FLOOR * copy else Status.FAIL, detail)


def _run(argv: list[str], root: Path, timeout_s: float) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o for o in (exc.stdout, exc.stderr) if o)
        return 124, f"{output}\n(timed out after {timeout_s:.0f} s)"
    return done.returncode, done.stdout + done.stderr


def pytest(root: Path, timeout_s: float) -> StepResult:
    tests = [t for t in CUDA_TESTS if (root / t).is_file()]
    if not tests:
        return StepResult("pytest", Status.SKIP, f"no CUDA tests under {root} (they are in a checkout)")
    code, out = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests], root, timeout_s)
    counts = re.findall(r"\d+ (?:passed|failed|skipped|errors?)", out)
    return StepResult("pytest", Status.PASS if code == 0 else Status.FAIL, ", ".join(counts) or out[-300:])


def launches(root: Path, timeout_s: float) -> list[StepResult]:
    recipe = root / "recipes/quickstart.yaml"
    if not recipe.is_file():
        return [StepResult("launch", Status.SKIP, f"no {recipe} (it is in a checkout)")]
    results = []
    for name, overrides in LAUNCHES.items():
        sets = [arg for kv in ["nproc_per_node=1", "name=gpucheck", *overrides] for arg in ("--set", kv)]
        code, out = _run([sys.executable, "-m", "zerorun.cli", "launch", str(recipe), *sets], root, timeout_s)
        losses = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", out)]
        why = [w for w, bad in (
            (f"exit code {code}", code != 0), ("no 'done:' line", "done: " not in out),
            ("the kernel fell back to torch", "kernel is unavailable" in out),
            ("the loss did not fall", len(losses) < 2 or losses[-1] >= losses[0])) if bad]
        detail = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if len(losses) >= 2 else out[-300:].strip()
        results.append(StepResult(f"launch {name}", Status.FAIL if why else Status.PASS,
                                  f"{'; '.join(why)}: {detail}" if why else detail))
    return results


def run(options: Options, report: Callable[[StepResult], None] = lambda r: None) -> list[StepResult]:
    """The chosen steps in order, each reported as it ends; after the environment, no CUDA means SKIP."""
    results: list[StepResult] = []

    def add(*new: StepResult) -> None:
        for result in new:
            results.append(result)
            report(result)

    env = environment()
    add(env)
    if env.status is not Status.PASS:
        add(*(StepResult(s, Status.SKIP, "no CUDA device") for s in options.steps if s != "environment"))
        return results
    device = torch.device("cuda")
    actions: dict[str, Callable[[], list[StepResult]]] = {
        "build": lambda: [build()],
        "numerics": lambda: [numerics(device, options.max_numel)],
        "bandwidth": lambda: [bandwidth()],
        "pytest": lambda: [pytest(options.root, options.timeout_s)],
        "launch": lambda: launches(options.root, options.timeout_s),
    }
    for step in options.steps:
        if step == "environment":
            continue
        start = time.perf_counter()
        try:
            new = actions[step]()
        except Exception as exc:  # a check that crashes is a failed check, and the next ones still run
            new = [StepResult(step, Status.FAIL, f"{type(exc).__name__}: {exc}")]
        add(*(StepResult(r.step, r.status, f"{r.detail} ({time.perf_counter() - start:.0f} s)") for r in new))
    return results


def write_json(results: list[StepResult], path: Path) -> None:
    path.write_text(json.dumps([dict(asdict(r), status=r.status.value) for r in results], indent=1))


def summary(results: list[StepResult]) -> str:
    counts = ", ".join(f"{s.value} {sum(r.status is s for r in results)}" for s in Status)
    return f"zerorun bench gpu: {counts}"
