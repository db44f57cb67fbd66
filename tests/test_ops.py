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


ISA_LEVELS = {"generic": 0, "avx2": 1, "avx512": 2}


def _use_isa(name: str) -> str:
    """Run the CPU kernel's `name` variant from now on (the caller restores the default), or skip."""
    used = ops.use_cpu_isa(ISA_LEVELS[name])
    if used != name:
        ops.use_cpu_isa(-1)
        pytest.skip(f"this CPU has no {name} (the kernel would run {used})")
    return used


@pytest.fixture(params=["generic", "avx2", "avx512"])
def isa(request: pytest.FixtureRequest, cpu_kernel: None) -> str:
    """Each compiled variant of the CPU kernel this CPU can run (on x86-64: baseline, AVX2+FMA, AVX-512)."""
    used = _use_isa(request.param)
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


@pytest.mark.parametrize("numel", [300_001, 2 * 32768 + 5])
def test_kernel_gives_one_threads_bits_with_many_threads(cpu_kernel: None, numel: int) -> None:
    """Threads split the shard and take grains from each other's ranges; every element is updated exactly once
    (twice or never would change its bits), and by the same arithmetic, so results equal one thread's."""
    results = []
    for threads in (1, 2, 3, 5):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ours, _, copy = _reference_run(numel, True, steps=2, grad_divisor=4.0, grad_dtype=torch.bfloat16,
                                           lowp=torch.bfloat16)
            results.append((ours, copy))
        finally:
            torch.set_num_threads(previous)
    for ours, copy in results[1:]:
        assert torch.equal(ours, results[0][0]) and torch.equal(copy, results[0][1])


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


def _torch_has_vector_adam() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_fma_kernels_equal_torch_cpu_fused_adamw_bit_for_bit(cpu_kernel: None, variant: str) -> None:
    """What docs/kernels.md claims: adam.h follows torch's CPU fused AdamW operation for operation. A length
    of whole vectors (torch's scalar tail, which rounds differently, never runs), 10 steps, in place."""
    if not _torch_has_vector_adam():
        pytest.skip("needs torch's AVX2/AVX-512 fused Adam")
    _use_isa(variant)
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
    """Issue 57: the first run built the Adam kernel in silence (step 1 took 9 s, the ETA said 9 minutes). The build
    takes 0.2 s of a stand-in clock: what is printed and counted is exact, however loaded the machine."""
    import time

    from zerorun import kernel_cache

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def compile_slowly(spec: kernel_cache.KernelSpec, directory) -> object:
        clock[0] += 0.2
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


def _second_moments(numel: int) -> torch.Tensor:
    """exp_avg_sq over every magnitude a float holds (subnormals to 2^127), with 0, inf and NaN among them."""
    torch.manual_seed(0)
    values = torch.exp2(torch.empty(numel, dtype=torch.float64).uniform_(-149, 127.9)).float()
    values[:5] = torch.tensor([0.0, 1e-45, 3.0e38, float("inf"), float("nan")])
    return values


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    both_nan = a.isnan() & b.isnan()
    return bool(torch.equal(both_nan, a.isnan() | b.isnan()) and
                torch.equal(a.masked_fill(both_nan, 0).view(torch.int32), b.masked_fill(both_nan, 0).view(torch.int32)))


@pytest.mark.parametrize("variant", ["avx2", "avx512"])
def test_exact_quotient_by_the_bias_correction_equals_torchs_division(cpu_kernel: None, variant: str) -> None:
    """With an FMA the kernel multiplies sqrt(v) by 1 / sqrt(1 - beta2^step) and corrects the quotient by its
    remainder instead of dividing (adam.h). The update's result shows every bit of that quotient when the
    params start at 0 and the gradient is 0, so compare with torch's division over second moments of every
    magnitude, and over bias corrections of many steps and beta2s (an inf second moment must give torch's 0)."""
    if not _torch_has_vector_adam():
        pytest.skip("needs torch's AVX2/AVX-512 fused Adam")
    _use_isa(variant)
    numel = 1 << 15
    exp_avg_sq = _second_moments(numel)
    exp_avg = torch.randn(numel)
    try:
        for beta2 in (0.95, 0.999, 0.99999):
            for step in (1, 2, 3, 10, 77, 1000, 30000):
                hyper = {"lr": 1.0, "beta1": 0.9, "beta2": beta2, "eps": 1e-8, "weight_decay": 0.0}
                ours = [torch.zeros(numel), torch.zeros(numel), exp_avg.clone(), exp_avg_sq.clone()]
                theirs = [t.clone() for t in ours]
                ops.adamw_step(*ours, step=step, **hyper)
                ops._torch_adamw_step(*theirs, step, *hyper.values(), 1, 1.0, None)
                assert all(_same_bits(a, b) for a, b in zip(ours, theirs)), (beta2, step)
    finally:
        ops.use_cpu_isa(-1)
