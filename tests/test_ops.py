"""zerorun.ops.adamw_step: our CPU kernel (every instruction-set variant) and torch's fallback compute
torch.optim.Adam/AdamW's update, unscale gradients in the same pass, and write an exact low-precision copy.

The CPU kernel is compiled for real here (into the user's kernel cache): a machine without a C++
compiler and ninja fails `test_cpu_kernel_builds`, on purpose, since CI must prove the kernel builds.
"""

from __future__ import annotations

import pytest
import torch

from zerorun import ops

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
# A few fp32 ulps at the parameters' scale after several steps (torch's for-loop and fused kernels
# differ from each other by as much); the kernel matches torch's fused one to the bit on most elements.
TOLERANCE = {"rtol": 1e-6, "atol": 3e-7}


@pytest.fixture(scope="module")
def cpu_kernel() -> None:
    line = ops.build(["cpu_adam"])["cpu_adam"]
    assert line.startswith("loaded"), line


@pytest.fixture(params=["best", "generic"])
def isa(request: pytest.FixtureRequest, cpu_kernel: None) -> str:
    """Each compiled variant of the CPU kernel (AVX2+FMA and baseline on x86-64)."""
    used = ops.use_cpu_isa(-1 if request.param == "best" else 0)
    yield used
    ops.use_cpu_isa(-1)


@pytest.fixture
def torch_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERORUN_KERNELS", "off")
    monkeypatch.setattr(ops, "_loaded", {})


def _reference_run(numel: int, decoupled: bool, steps: int, grad_divisor: float, grad_dtype: torch.dtype,
                   lowp: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(our params, torch.optim's params, our low-precision copy) after `steps` updates on the same grads."""
    torch.manual_seed(numel)
    params = torch.randn(numel)
    reference = params.clone().requires_grad_()
    optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_class([reference], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                weight_decay=HYPER["weight_decay"], foreach=False)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    copy = torch.empty(numel, dtype=lowp) if lowp is not None else None
    for step in range(1, steps + 1):
        grads = (torch.randn(numel) * 3).to(grad_dtype)
        reference.grad = grads.float() / grad_divisor
        optimizer.step()
        ops.adamw_step(params, grads.clone(), exp_avg, exp_avg_sq, step=step, decoupled=decoupled,
                       grad_divisor=grad_divisor, lowp_out=copy, **HYPER)
    return params, reference.detach(), copy


def test_cpu_kernel_builds(cpu_kernel: None) -> None:
    assert ops.status()["cpu_adam"].startswith("loaded")


@pytest.mark.parametrize("numel", [1, 7, 1023, 100003])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_kernel_matches_torch_optim_over_steps_with_unscaling(isa: str, numel: int, decoupled: bool) -> None:
    ours, reference, _ = _reference_run(numel, decoupled, steps=5, grad_divisor=8.0, grad_dtype=torch.float32)
    torch.testing.assert_close(ours, reference, **TOLERANCE)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_low_precision_grads(isa: str, grad_dtype: torch.dtype) -> None:
    ours, reference, _ = _reference_run(1023, True, steps=3, grad_divisor=2.0, grad_dtype=grad_dtype)
    torch.testing.assert_close(ours, reference, **TOLERANCE)


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_kernel_low_precision_copy_equals_the_cast_master(isa: str, lowp: torch.dtype) -> None:
    ours, reference, copy = _reference_run(100003, True, steps=3, grad_divisor=1.0, grad_dtype=torch.float32,
                                           lowp=lowp)
    torch.testing.assert_close(ours, reference, **TOLERANCE)
    assert torch.equal(copy, ours.to(lowp))


@pytest.mark.parametrize("lowp", [torch.bfloat16, torch.float16])
def test_low_precision_copy_rounds_special_values_like_torch(isa: str, lowp: torch.dtype) -> None:
    """Ties, subnormals, overflow to inf, signed zeros, inf and NaN; lr=0 leaves the params as they are."""
    info = torch.finfo(lowp)
    tie = 1.0 + float(info.eps) / 2  # halfway between 1 and the next value: rounds to even
    values = [0.0, -0.0, 1.0, tie, -tie, 1.0 + float(info.eps) * 1.5, float(info.tiny) / 3, 1e-40, -1e-40,
              float(info.max) * 1.01, -float(info.max) * 1.01, 65519.0, 65520.0, 3.0e38, float("inf"),
              float("-inf"), float("nan"), 1e-8, 6.1e-5, 5.96e-8, 2.98e-8]
    params = torch.tensor(values * 5, dtype=torch.float32)  # > one vector width, with a tail
    before = params.clone()
    copy = torch.empty_like(params, dtype=lowp)
    ops.adamw_step(params, torch.zeros_like(params), torch.zeros_like(params), torch.zeros_like(params), step=1,
                   lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, lowp_out=copy)
    assert torch.equal(params.nan_to_num(), before.nan_to_num())
    expected = before.to(lowp)
    assert torch.equal(copy.isnan(), expected.isnan())
    assert torch.equal(copy.nan_to_num().view(torch.int16), expected.nan_to_num().view(torch.int16))


def test_kernel_matches_torch_fused_with_many_threads(cpu_kernel: None) -> None:
    """Threads split the shard; each element's arithmetic is the same, so results equal one thread's."""
    numel = 300_001
    results = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append(_reference_run(numel, True, steps=2, grad_divisor=4.0, grad_dtype=torch.float32)[0])
        finally:
            torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_torch_fallback_matches_torch_optim_and_writes_the_copy(torch_fallback: None, decoupled: bool) -> None:
    ours, reference, copy = _reference_run(1023, decoupled, steps=5, grad_divisor=8.0, grad_dtype=torch.bfloat16,
                                           lowp=torch.bfloat16)
    assert ops.status()["cpu_adam"].startswith("unavailable: disabled")
    torch.testing.assert_close(ours, reference, **TOLERANCE)
    assert torch.equal(copy, ours.to(torch.bfloat16))


def test_kernel_and_fallback_agree(cpu_kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, _, _ = _reference_run(100003, True, steps=5, grad_divisor=8.0, grad_dtype=torch.float32)
    monkeypatch.setenv("ZERORUN_KERNELS", "off")
    monkeypatch.setattr(ops, "_loaded", {})
    fallback, _, _ = _reference_run(100003, True, steps=5, grad_divisor=8.0, grad_dtype=torch.float32)
    torch.testing.assert_close(kernel, fallback, rtol=1e-6, atol=1.2e-7)


def test_empty_shard_is_a_no_op(cpu_kernel: None) -> None:
    empty = torch.empty(0)
    ops.adamw_step(empty, empty, empty, empty, step=1, **HYPER)


@pytest.mark.parametrize("bad", ["params_dtype", "numel", "lowp_dtype", "strided"])
def test_misuse_is_a_value_error_naming_the_tensor(bad: str) -> None:
    tensors = {"params": torch.zeros(8), "grads": torch.zeros(8), "exp_avg": torch.zeros(8),
               "exp_avg_sq": torch.zeros(8)}
    lowp_out = None
    if bad == "params_dtype":
        tensors["params"] = torch.zeros(8, dtype=torch.float64)
    elif bad == "numel":
        tensors["exp_avg"] = torch.zeros(7)
    elif bad == "lowp_dtype":
        lowp_out = torch.zeros(8, dtype=torch.float32)
    else:
        tensors["grads"] = torch.zeros(16)[::2]
    with pytest.raises(ValueError, match="adamw_step: (params|exp_avg|lowp_out|grads)"):
        ops.adamw_step(*tensors.values(), step=1, lowp_out=lowp_out, **HYPER)


def test_avx2_kernel_equals_torch_cpu_fused_adamw_bit_for_bit(cpu_kernel: None) -> None:
    """What docs/kernels.md claims: adam.h follows torch's CPU fused AdamW operation for operation. A length
    of whole vectors (torch's scalar tail, which rounds differently, never runs), 10 steps, in place."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or ops.use_cpu_isa(1) != "avx2":
        pytest.skip("needs AVX2+FMA for both torch's kernel and ours")
    try:
        numel = 1 << 16
        ours = torch.randn(numel)
        theirs = ours.clone()
        states = [torch.zeros(numel) for _ in range(4)]
        for step in range(1, 11):
            grad = torch.randn(numel) * 1e-2
            ops.adamw_step(ours, grad.clone(), states[0], states[1], step=step, grad_divisor=4.0, **HYPER)
            ops._torch_adamw_step(theirs, grad.clone(), states[2], states[3], step, HYPER["lr"], HYPER["beta1"],
                                  HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], 1, 4.0, None)
        assert torch.equal(ours, theirs) and torch.equal(states[0], states[2]) and torch.equal(states[1], states[3])
    finally:
        ops.use_cpu_isa(-1)


def test_a_first_build_says_so_and_its_time_is_counted_apart(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 57: the first run built the Adam kernel in silence (step 1 took 9 s, the ETA said 9 minutes)."""
    import time

    from zerorun import kernel_cache

    def compile_slowly(spec: kernel_cache.KernelSpec, directory) -> object:
        time.sleep(0.2)
        library = directory / f"zerorun_{spec.kind}.so"
        library.write_bytes(b"a stand-in: the build's time and words are what is tested")
        kernel_cache._write_atomically(directory / "BUILT", library.name)
        return library

    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_compile", compile_slowly)
    monkeypatch.setattr(ops, "_loaded", {})
    monkeypatch.setattr(ops, "_warned", set())
    before = ops.build_seconds()
    ops.load_kernel("cpu_adam")
    err = capsys.readouterr().err
    assert "zerorun: building the CPU Adam kernel (once per machine and torch version; the other ranks of this " \
           "node wait for it) ..." in err
    assert "zerorun: built the CPU Adam kernel in 0.2 s" in err
    assert ops.build_seconds() - before >= 0.2
    assert kernel_cache.previous_build_s("cpu_adam") == 0.2  # the next build says "~0 s last time"
    ops.load_kernel("cpu_adam")  # loaded (or refused) once per process: nothing more is built or said
    assert capsys.readouterr().err == "" and ops.build_seconds() - before < 0.3
