"""Building the kernels: a cache per machine/torch/source, one builder per node under a file lock,
and failures that say why once and fall back to torch with the right numbers."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.launch.launched import subprocess_env
from zerorun import kernel_cache, ops
from zerorun.cli import app

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}

# Each racer waits until both have started, then asks for the kernel; `_compile` is wrapped to
# leave a mark, so the test can count how many processes compiled.
RACER = """
import json, sys, time
from pathlib import Path
import torch
from zerorun import kernel_cache, ops

me, sync = sys.argv[1], Path(sys.argv[2])
real_compile = kernel_cache._compile
def marked_compile(spec, directory):
    (sync / f"compiled-{me}").touch()
    return real_compile(spec, directory)
kernel_cache._compile = marked_compile
(sync / f"ready-{me}").touch()
while len(list(sync.glob("ready-*"))) < 2:
    time.sleep(0.01)
state = ops.load_kernel("cpu_adam")
params, grads = torch.randn(1000), torch.randn(1000)
expected = params.clone()
hyper = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
ops._torch_adamw_step(expected, grads.clone(), torch.zeros(1000), torch.zeros(1000), 1, 1e-2, 0.9, 0.999, 1e-8, 0.1,
                      1, 1.0, None)
ops.adamw_step(params, grads, torch.zeros(1000), torch.zeros(1000), **hyper)
print(json.dumps({"loaded": state.lib is not None, "reason": state.reason,
                  "right": torch.allclose(params, expected, rtol=1e-6, atol=1e-7)}))
"""

# A compiler that works for torch's version probes but fails every compilation, after a second.
FAILING_CXX = """#!/bin/sh
for arg in "$@"; do
  if [ "$arg" = "-c" ]; then sleep 1; echo "cpu_adam.cpp:1:1: error: simulated compiler failure" >&2; exit 1; fi
done
exec g++ "$@"
"""


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache for this test, and a process that has loaded nothing yet."""
    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ZERORUN_KERNELS", raising=False)
    monkeypatch.setattr(ops, "_loaded", {})
    monkeypatch.setattr(ops, "_warned", set())
    return tmp_path / "cache"


@pytest.fixture
def failing_cxx(tmp_path: Path) -> str:
    script = tmp_path / "failing-c++"
    script.write_text(FAILING_CXX)
    script.chmod(0o755)
    return str(script)


def _race(tmp_path: Path, env: dict[str, str]) -> tuple[list[dict], int]:
    """Two processes asking for cpu_adam at once: their reports and how many of them compiled."""
    sync = tmp_path / "sync"
    sync.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(i), str(sync)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for i in range(2)]
    reports = []
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        assert racer.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports, len(list(sync.glob("compiled-*")))


def _one_step(**kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(adamw_step's params, the torch fallback's params) after one identical step."""
    params, grads = torch.randn(1023), torch.randn(1023)
    expected = params.clone()
    ops._torch_adamw_step(expected, grads.clone(), torch.zeros(1023), torch.zeros(1023), 1, HYPER["lr"],
                          HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], 1, 4.0, None)
    ops.adamw_step(params, grads, torch.zeros(1023), torch.zeros(1023), step=1, grad_divisor=4.0, **HYPER, **kwargs)
    return params, expected


def test_cache_dir_follows_the_environment_and_the_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ZERORUN_CACHE", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch-ext"))
    monkeypatch.delenv("CXX", raising=False)
    under_torch = ops.build_dir("cpu_adam")
    assert under_torch.parent == tmp_path / "torch-ext" / "zerorun"
    assert under_torch.name.startswith(f"{torch.__version__}-cpu_adam-")
    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path / "zr"))
    assert ops.build_dir("cpu_adam").parent == tmp_path / "zr" / "kernels"
    monkeypatch.setenv("CXX", "clang++")
    assert ops.build_dir("cpu_adam").name != under_torch.name, "another compiler must not load this build"


@pytest.mark.slow
def test_two_processes_racing_compile_once_and_both_load(fresh_cache: Path, tmp_path: Path) -> None:
    env = dict(subprocess_env(), ZERORUN_CACHE=str(fresh_cache))
    env.pop("CXX", None)
    reports, compiled = _race(tmp_path, env)
    assert compiled == 1, reports
    assert all(r["loaded"] and r["right"] for r in reports), reports


@pytest.mark.slow
def test_a_failed_build_is_not_repeated_by_the_rank_that_waited(fresh_cache: Path, tmp_path: Path,
                                                                failing_cxx: str) -> None:
    env = dict(subprocess_env(), ZERORUN_CACHE=str(fresh_cache), CXX=failing_cxx)
    reports, compiled = _race(tmp_path, env)
    assert compiled == 1, reports
    for report in reports:
        assert not report["loaded"] and report["right"], report
        assert "simulated compiler failure" in report["reason"] and "build.log" in report["reason"], report


def test_missing_compiler_warns_once_with_the_reason_and_falls_back(fresh_cache: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ours, expected = _one_step(lowp_out=torch.empty(1023, dtype=torch.bfloat16))
            assert torch.equal(ours, expected)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and issubclass(caught[0].category, ops.KernelWarning), messages
    assert "no C++ compiler: `/nonexistent/c++` not found" in messages[0]
    assert ops.status()["cpu_adam"].startswith("failed: no C++ compiler")


def test_compile_error_is_summarised_and_logged(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                failing_cxx: str) -> None:
    monkeypatch.setenv("CXX", failing_cxx)
    line = ops.build(["cpu_adam"])["cpu_adam"]
    assert line.startswith("failed: build failed: cpu_adam.cpp:1:1: error: simulated compiler failure"), line
    assert "simulated compiler failure" in (ops.build_dir("cpu_adam") / "build.log").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, expected = _one_step()
    assert torch.equal(ours, expected)


def test_status_builds_nothing_and_reports_each_kernel(fresh_cache: Path) -> None:
    status = ops.status()
    assert set(status) == {"cpu_adam", "fused_adam", "aio", "quantize", "quantize_cuda"}
    assert status["cpu_adam"].startswith("not built yet")
    if not torch.cuda.is_available():
        assert status["fused_adam"] == status["quantize_cuda"] == "unavailable: no CUDA device"
    assert not fresh_cache.exists()


@pytest.mark.slow
def test_env_build_prebuilds_and_reports(fresh_cache: Path) -> None:
    result = CliRunner().invoke(app, ["env", "--build", "--json"])
    assert result.exit_code == 0, result.output
    assert "cpu_adam: loaded" in result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["kernels"]["cpu_adam"].startswith("loaded")
    assert ops.build_dir("cpu_adam").is_relative_to(fresh_cache)


def test_env_build_fails_with_status_1_when_a_kernel_cannot_build(fresh_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    result = CliRunner().invoke(app, ["env", "--build"])
    assert result.exit_code == 1
    assert "cpu_adam: failed: no C++ compiler" in result.output


def test_disabled_kernels_fall_back_without_a_warning(fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_KERNELS", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours, expected = _one_step()
    assert torch.equal(ours, expected)
    assert ops.status()["cpu_adam"] == "unavailable: disabled (ZERORUN_KERNELS=off)"
    assert not fresh_cache.exists()


def test_installed_sources_are_found() -> None:
    assert (ops.sources_dir() / "adam.h").is_file() and (ops.sources_dir() / "cpu_adam.cpp").is_file()
    assert os.access(ops.sources_dir() / "fused_adam.cu", os.R_OK)


@pytest.mark.skipif(shutil.which("objdump") is None or os.uname().machine != "x86_64",
                    reason="reads the x86-64 machine code with objdump")
def test_every_x86_variant_of_the_cpu_adam_kernel_is_vectorised() -> None:
    """The kernel is scalar C++ that GCC vectorises, and GCC leaves a loop scalar, silently, when one select in it
    may trap (before -fno-trapping-math and the 32-bit lerp flag, 25 of the 36 AVX2 variants ran as scalar
    code, bf16 gradients with their cast copy among them). Each variant must take its square roots a vector at
    a time: four (SSE2), eight (AVX2), eight or sixteen (AVX-512)."""
    assert ops.build(["cpu_adam"])["cpu_adam"].startswith("loaded")
    library = kernel_cache.built_library(ops.build_dir("cpu_adam"))
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(library)], capture_output=True,
                             text=True, check=True).stdout
    widest = {"generic": r"sqrtps\s+%xmm", "avx2": r"vsqrtps\s+%ymm", "avx512": r"vsqrtps\s+%[yz]mm"}
    count = dict.fromkeys(widest, 0)
    scalar: dict[str, list[str]] = {isa: [] for isa in widest}
    for function in re.split(r"\n(?=[0-9a-f]+ <)", listing):
        named = re.match(r"[0-9a-f]+ <[^>]*::range_(generic|avx2|avx512)<([^>]*)>", function)
        if named:
            count[named[1]] += 1
            if not re.search(widest[named[1]], function):
                scalar[named[1]].append(named[2])
    assert count == {"generic": 36, "avx2": 36, "avx512": 36}  # decoupled x unscale x 3 gradient x 3 copy dtypes
    assert scalar == {isa: [] for isa in widest}


@pytest.fixture(scope="module")
def built_entry() -> Path:
    """The cache entry of cpu_adam built where this process keeps kernels (what `zerorun env --build` and the
    vectorisation test above use: built once, not per test)."""
    assert ops.build(["cpu_adam"])["cpu_adam"].startswith("loaded")
    return ops.build_dir("cpu_adam")


def test_a_damaged_cache_entry_says_how_to_rebuild(built_entry: Path, fresh_cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(built_entry, ops.build_dir("cpu_adam"))  # a good entry, then damaged: no compile needed
    library = ops.build_dir("cpu_adam") / (ops.build_dir("cpu_adam") / "BUILT").read_text()
    assert library.is_file() and ops.build_dir("cpu_adam").is_relative_to(fresh_cache)
    damaged = library.with_name("damaged.so")
    damaged.write_bytes(b"not a shared library")
    (ops.build_dir("cpu_adam") / "BUILT").write_text(damaged.name)
    monkeypatch.setattr(ops, "_loaded", {})
    with pytest.warns(ops.KernelWarning, match=re.escape(f"delete {ops.build_dir('cpu_adam')} to rebuild")):
        ours, expected = _one_step()
    assert torch.equal(ours, expected)


# -- the CUDA toolkit behind a wrapper script, and what a failed link says ------------------------------
# A stand-in for a CUDA toolkit's nvcc: its version banner, and the environment lines a verbose dry run
# prints (on stderr, as nvcc does), `#$ TOP=` among them.
FAKE_NVCC = """#!/bin/sh
here=$(cd "$(dirname "$0")" && pwd)
case "$1" in
  --version) echo "Cuda compilation tools, release 12.4, V12.4.131"; exit 0 ;;
  -v) echo "#\\$ _HERE_=$here" >&2; echo "#\\$ TOP=$here/.." >&2
      echo "#\\$ LIBRARIES=  \\"-L$here/../lib64\\"" >&2; exit 0 ;;
esac
exit 1
"""


@pytest.fixture
def wrapped_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A toolkit in cuda-12.4/ (bin/nvcc, lib64/libcudart.so) whose nvcc is reached through a wrapper
    script in wrappers/bin, first on PATH; no CUDA_HOME. Returns the toolkit's root."""
    root = tmp_path / "cuda-12.4"
    (root / "bin").mkdir(parents=True)
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so").write_bytes(b"")
    (root / "bin" / "nvcc").write_text(FAKE_NVCC)
    wrapper = tmp_path / "wrappers" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec "{root}/bin/nvcc" "$@"\n')
    for script in (root / "bin" / "nvcc", wrapper):
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    return root


def test_cuda_home_is_where_nvcc_says_it_lives_not_the_folder_above_a_wrapper_script(wrapped_nvcc: Path,
                                                                                     monkeypatch) -> None:
    from zerorun import toolchain

    torch_guess = os.path.dirname(os.path.dirname(shutil.which("nvcc")))  # torch.utils.cpp_extension's guess #2
    assert torch_guess == str(wrapped_nvcc.parent / "wrappers")
    assert toolchain.cuda_home() == str(wrapped_nvcc.resolve())
    monkeypatch.setenv("CUDA_HOME", "/opt/chosen-cuda")  # an explicit choice wins
    assert toolchain.cuda_home() == "/opt/chosen-cuda"


def test_torch_builds_and_links_with_the_toolkit_nvcc_names(wrapped_nvcc: Path) -> None:
    from torch.utils import cpp_extension

    from zerorun import toolchain

    before = cpp_extension.CUDA_HOME
    with toolchain.torch_cuda_home(toolchain.cuda_home()):
        root = wrapped_nvcc.resolve()
        assert cpp_extension._join_cuda_home("bin", "nvcc") == str(root / "bin" / "nvcc")
        wanted = dict(extra_ldflags=[], with_cuda=True, with_sycl=False, verbose=False, is_standalone=False)
        accepted = inspect.signature(cpp_extension._prepare_ldflags).parameters  # private; varies by torch version
        ldflags = cpp_extension._prepare_ldflags(**{k: v for k, v in wanted.items() if k in accepted})
        assert f"-L{root / 'lib64'}" in ldflags and "-lcudart" in ldflags, ldflags
    assert cpp_extension.CUDA_HOME == before


def test_a_failed_link_shows_the_linker_message_its_command_and_the_fix(fresh_cache: Path, tmp_path: Path) -> None:
    # cpu_adam linked the way torch links a CUDA extension under a wrong CUDA_HOME: a real ld failure
    wrong = tmp_path / "usr-local" / "lib64"
    spec = dataclasses.replace(ops.SPECS["cpu_adam"], ldflags=(*ops.SPECS["cpu_adam"].ldflags, f"-L{wrong}",
                                                               "-lcudart"))
    directory = tmp_path / "build"
    directory.mkdir()
    with pytest.raises(ops.BuildError) as failure:
        kernel_cache._compile(spec, directory)
    message = str(failure.value)
    assert message.startswith("build failed: ") and "cannot find -lcudart" in message, message
    assert "collect2: error: ld returned 1 exit status" in message, message
    assert "link command: " in message and f"-L{wrong} -lcudart" in message, message
    assert "set CUDA_HOME to the CUDA toolkit's root" in message, message
