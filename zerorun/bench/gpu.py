"""`zerorun bench gpu`: the whole proof of a GPU machine, in one command (docs/gpu.md).

CI has no GPU, so the CUDA paths are written to run their logic on the CPU too (the CUDA stand-in:
tests/runtime/test_cuda_standin.py); this command runs what only a GPU can, in order:

- environment: torch's CUDA build, nvcc, CUDA_HOME, and the checkout's commit (the figures it gives
  are that commit's);
- build, numerics, bandwidth: the CUDA Adam kernel (`bench/gpu_kernel.py`);
- codec: the CUDA block int8 codec of qwZ/qgZ against a device-to-device copy (its bits are the
  pytest step's);
- pytest: the CUDA tests of a checkout, each failure named;
- launch: the quick start as users start it, shortened: world-size-1 NCCL at stages 2 and 3 with and
  without offload, and 2 and 3 ranks sharing the GPU over gloo at stages 0-3, a few at a time;
- sanitizer: torch's CUDA stream sanitizer (`TORCH_CUDA_SANITIZER=1`) over the CUDA parity tests and
  one offloaded launch with the publish overlapped (side streams, pinned staging): zero reports;
- deepspeed: where `deepspeed` imports, ZeRO-Offload side by side (`zerorun bench offload --quick`).

Each step says PASS, FAIL or SKIP with its reason, and a FAIL names the failing test or launch;
without CUDA every step after the environment skips, so the command stays runnable anywhere.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from zerorun import ops
from zerorun.bench import gpu_kernel
from zerorun.toolchain import cuda_home

STEPS = ("environment", "build", "numerics", "bandwidth", "codec", "pytest", "launch", "sanitizer", "deepspeed")
CUDA_TESTS = ("tests/test_kernels_cuda.py", "tests/runtime/test_cuda_parity.py", "tests/runtime/test_wire.py",
              "tests/test_quantize_kernel.py")
SANITIZED_TESTS = ("tests/runtime/test_cuda_parity.py",)
CODEC_NUMEL = 256 * 10**6  # fp32 elements: 1 GB, far past the L2, as the Adam kernel's bandwidth step
BANDWIDTH_FLOOR = 0.7  # of a device-to-device copy: the update is memory-bound, so less is a slow kernel
LAUNCH_STEPS = 8  # optimizer steps per launch: enough for the loss to fall, short enough for a dozen launches
PARALLEL_LAUNCHES = 4  # launches at once: small jobs, one GPU and a host of many cores
BUDGET_S = 480  # the whole command on one H100/H200: what a session lent a GPU can afford, with a rerun


@dataclass(frozen=True)
class Launch:
    """The quick start on `ranks` workers with `overrides`."""

    name: str
    ranks: int
    overrides: tuple[str, ...]


_NCCL = ("launch.backend=nccl", "precision=bf16")
LAUNCHES = (
    Launch("1 GPU, nccl, stage 2", 1, (*_NCCL, "zero.stage=2")),
    Launch("1 GPU, nccl, stage 2, optimizer on the CPU", 1, (*_NCCL, "zero.stage=2", "zero.offload_optimizer=cpu")),
    Launch("1 GPU, nccl, stage 3", 1, (*_NCCL, "zero.stage=3")),
    Launch("1 GPU, nccl, stage 3, optimizer and parameters on the CPU", 1,
           (*_NCCL, "zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu")),
    Launch("1 GPU, nccl, stage 3, qgZ + qwZ", 1,
           (*_NCCL, "zero.stage=3", "zero.quantized_gradients=true", "zero.quantized_weights=true")),
    *(Launch(f"{n} ranks on 1 GPU, gloo, stage {stage}", n, ("launch.backend=gloo", f"zero.stage={stage}"))
      for n in (2, 3) for stage in range(4)),
)
SANITIZED_LAUNCH = Launch("1 GPU, stage 2, optimizer on the CPU, publish overlapped, sanitized", 1,
                          (*_NCCL, "zero.stage=2", "zero.offload_optimizer=cpu", "zero.overlap_publish=true"))
SANITIZER_REPORT = re.compile(r"CSAN detected|CUDASanitizerErrors|data race", re.I)


class Status(enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class StepResult:
    step: str
    status: Status
    detail: str
    seconds: float = 0.0  # its own time (launches run several at once)

    def line(self) -> str:
        return f"{self.status.value} {self.step}: {self.detail} ({_seconds(self.seconds)})"


@dataclass(frozen=True)
class Options:
    steps: tuple[str, ...] = STEPS
    root: Path = Path(".")  # a checkout: where tests/ and recipes/ are
    max_numel: int = 10**12
    timeout_s: float = 300.0  # per subprocess (the tests, each launch)


def commit(root: Path) -> str:
    """The checkout's commit (short), "+changes" where its tracked files differ from it; "unknown" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.returncode else "")


def environment(root: Path = Path(".")) -> StepResult:
    cuda = torch.version.cuda
    home = cuda_home() if cuda else None
    line = (f"torch {torch.__version__}, CUDA build {cuda or 'none'}, CUDA_HOME {home or 'none'}, "
            f"commit {commit(root)}")
    if not torch.cuda.is_available():
        return StepResult("environment", Status.SKIP, f"no CUDA device: {line}")
    return StepResult("environment", Status.PASS, f"{torch.cuda.get_device_name(0)}; {line}")


def build() -> StepResult:
    lines = ops.build(["fused_adam", "cpu_adam", "quantize_cuda"])
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


def codec() -> StepResult:
    """The CUDA codec's quantize and dequantize at BANDWIDTH_FLOOR of a device-to-device copy or better."""
    from zerorun.bench import quantize

    # the copy's size: at 64M elements a call's fixed ~45 us (launch, allocation, sync) cost an H200 15 points
    bench = quantize.run([CODEC_NUMEL], repeats=10, bandwidth_numel=CODEC_NUMEL, device="cuda")
    ours = {r.operation: r.gb_per_s for r in bench.results if r.implementation == "zerorun" and r.median_s}
    if not ours:
        note = next((r.note for r in bench.results if r.implementation == "zerorun"), "")
        return StepResult("codec", Status.FAIL, f"the CUDA codec did not run: {note}")
    detail = ", ".join(f"{op} {gbps:.0f} GB/s ({gbps / bench.bandwidth_gb_s:.0%})" for op, gbps in ours.items())
    slow = [op for op in ("quantize", "dequantize") if ours.get(op, 0) < BANDWIDTH_FLOOR * bench.bandwidth_gb_s]
    detail += f" of a {bench.bandwidth_gb_s:.0f} GB/s copy"
    return StepResult("codec", Status.FAIL if slow else Status.PASS, (f"below {BANDWIDTH_FLOOR:.0%}: "
                                                                        f"{', '.join(slow)}; " if slow else "") + detail)


def _run(argv: list[str], root: Path, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        output = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o for o in (exc.stdout, exc.stderr) if o)
        return 124, f"{output}\n(timed out after {timeout_s:.0f} s)"
    return done.returncode, done.stdout + done.stderr


def pytest(root: Path, timeout_s: float, tests: tuple[str, ...] = CUDA_TESTS, step: str = "pytest",
           env: dict[str, str] | None = None) -> StepResult:
    """`tests` of the checkout at `root`; a failure is named with its first line."""
    present = [t for t in tests if (root / t).is_file()]
    if not present:
        return StepResult(step, Status.SKIP, f"no CUDA tests under {root} (they are in a checkout)")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        code, out = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          f"--junitxml={report}", *present], root, timeout_s, env)
        counts, failures = _junit(report) if report.is_file() else ({}, [])
    detail = ", ".join(f"{n} {what}" for what, n in counts.items() if n) or out[-300:].strip()
    if failures:
        detail += "; FAILED " + "; ".join(failures)
    sanitizer = _sanitizer_reports(out) if env and "TORCH_CUDA_SANITIZER" in env else []
    if sanitizer:
        detail += "; sanitizer: " + " | ".join(sanitizer)
    return StepResult(step, Status.PASS if code == 0 and not sanitizer else Status.FAIL, detail)


def _junit(path: Path) -> tuple[dict[str, int], list[str]]:
    """({passed, failed, errors, skipped}: count, ["file::test: first line of the failure", ...]) of a JUnit report."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ElementTree.parse(path).iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(getattr(outcome, "tag", ""), "passed")
        counts[kind] += 1
        if kind in ("failed", "errors") and outcome is not None:
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            why = (outcome.get("message") or outcome.text or "").strip().splitlines()
            failures.append(f"{name}: {why[0][:200] if why else kind}")
    return counts, failures


def _sanitizer_reports(output: str) -> list[str]:
    return [line.strip()[:200] for line in output.splitlines() if SANITIZER_REPORT.search(line)][:3]


def launch(root: Path, spec: Launch, timeout_s: float, env: dict[str, str] | None = None) -> StepResult:
    """One shortened quick start; PASS when it exits 0, says done, used the CUDA kernel and its loss fell."""
    step = f"launch {spec.name}"
    recipe = root / "recipes/quickstart.yaml"
    if not recipe.is_file():
        return StepResult(step, Status.SKIP, f"no {recipe} (it is in a checkout)")
    name = "gpucheck-" + re.sub(r"[^a-z0-9]+", "-", spec.name.lower()).strip("-")
    sets = [f"nproc_per_node={spec.ranks}", f"name={name}", f"train.steps={LAUNCH_STEPS}", "args=--log-every 1",
            *spec.overrides]
    argv = [sys.executable, "-m", "zerorun.cli", "launch", str(recipe), *(a for kv in sets for a in ("--set", kv))]
    started = time.perf_counter()
    code, out = _run(argv, root, timeout_s, env)
    seconds = time.perf_counter() - started
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", out)]
    sanitizer = _sanitizer_reports(out) if env and "TORCH_CUDA_SANITIZER" in env else []
    why = [w for w, bad in (
        (f"exit code {code}", code != 0), ("no 'done:' line", "done: " not in out),
        ("the kernel fell back to torch", "kernel is unavailable" in out),
        ("the loss did not fall", len(losses) < 2 or losses[-1] >= losses[0]),
        ("sanitizer: " + " | ".join(sanitizer), bool(sanitizer))) if bad]
    detail = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if len(losses) >= 2 else out[-300:].strip()
    return StepResult(step, Status.FAIL if why else Status.PASS, f"{'; '.join(why)}: {detail}" if why else detail,
                      seconds)


def launches(root: Path, timeout_s: float) -> list[StepResult]:
    """Every launch of LAUNCHES, PARALLEL_LAUNCHES at a time, reported in LAUNCHES' order."""
    with ThreadPoolExecutor(PARALLEL_LAUNCHES) as pool:
        return list(pool.map(lambda spec: launch(root, spec, timeout_s), LAUNCHES))


def sanitizer(root: Path, timeout_s: float) -> list[StepResult]:
    """The CUDA parity tests and one offloaded launch under torch's CUDA stream sanitizer: no reports."""
    env = {"TORCH_CUDA_SANITIZER": "1"}
    return [pytest(root, timeout_s, SANITIZED_TESTS, "sanitizer pytest", env),
            launch(root, SANITIZED_LAUNCH, timeout_s, env)]


def deepspeed_offload(root: Path, timeout_s: float) -> StepResult:
    """ZeRO-Offload beside DeepSpeed's, where DeepSpeed imports (docs/gpu.md says how to carry it offline)."""
    if importlib.util.find_spec("deepspeed") is None:
        return StepResult("deepspeed", Status.SKIP, "deepspeed does not import here: install it (or carry its wheel, "
                                                    "docs/gpu.md) to run ZeRO-Offload beside it")
    code, out = _run([sys.executable, "-m", "zerorun.cli", "bench", "offload", "--quick"], root, timeout_s)
    lines = [line for line in out.splitlines() if line.strip()]
    return StepResult("deepspeed", Status.PASS if code == 0 else Status.FAIL, " ".join(lines[-3:])[-400:])


def run(options: Options, report: Callable[[StepResult], None] = lambda r: None) -> list[StepResult]:
    """The chosen steps in order, each reported as it ends; after the environment, no CUDA means SKIP."""
    results: list[StepResult] = []

    def add(*new: StepResult) -> None:
        for result in new:
            results.append(result)
            report(result)

    env = environment(options.root)
    add(env)
    if env.status is not Status.PASS:
        add(*(StepResult(s, Status.SKIP, "no CUDA device") for s in options.steps if s != "environment"))
        return results
    device = torch.device("cuda")
    actions: dict[str, Callable[[], list[StepResult]]] = {
        "build": lambda: [build()],
        "numerics": lambda: [numerics(device, options.max_numel)],
        "bandwidth": lambda: [bandwidth()],
        "codec": lambda: [codec()],
        "pytest": lambda: [pytest(options.root, options.timeout_s)],
        "launch": lambda: launches(options.root, options.timeout_s),
        "sanitizer": lambda: sanitizer(options.root, options.timeout_s),
        "deepspeed": lambda: [deepspeed_offload(options.root, options.timeout_s)],
    }
    for step in options.steps:
        if step == "environment":
            continue
        start = time.perf_counter()
        try:
            new = actions[step]()
        except Exception as exc:  # a check that crashes is a failed check, and the next ones still run
            new = [StepResult(step, Status.FAIL, f"{type(exc).__name__}: {exc}")]
        elapsed = time.perf_counter() - start
        add(*(r if r.seconds else replace(r, seconds=elapsed) for r in new))
    return results


def write_json(results: list[StepResult], path: Path, root: Path = Path(".")) -> None:
    steps = [dict(asdict(r), status=r.status.value) for r in results]
    path.write_text(json.dumps({"commit": commit(root), "torch": torch.__version__, "steps": steps}, indent=1))


def summary(results: list[StepResult], seconds: float) -> str:
    counts = ", ".join(f"{s.value} {sum(r.status is s for r in results)}" for s in Status)
    over = f" (over the {BUDGET_S // 60:.0f}-minute budget)" if seconds > BUDGET_S else ""
    return f"zerorun bench gpu: {counts} in {_seconds(seconds)}{over}"


def _seconds(seconds: float) -> str:
    """`14.8 s`, `312 s`: a tenth where a whole second would round a short step to nothing."""
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds:.0f} s"
