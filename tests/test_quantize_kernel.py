"""The block int8 kernel (kernels/quantize.cpp) gives the same bits as torch's path in quantize.py, in every
instruction-set variant and thread count, for every dtype the wire sees: a rank with the kernel and a rank
without it must send and compute the same values. A block holding an inf or a NaN dequantizes to NaNs in
both, so an fp16 loss scaler still sees the overflow.

As with cpu_adam (tests/test_ops.py), the kernel is compiled for real here: a machine without a C++
compiler fails `test_the_quantize_kernel_builds`, on purpose.
"""

from __future__ import annotations

import pytest
import torch

from zerorun import ops
from zerorun.runtime.comm import quantize as codec
from zerorun.runtime.comm.quantize import BLOCK, Quantized

SIZES = [1, BLOCK - 1, BLOCK, 3 * BLOCK + 77]


@pytest.fixture(scope="module")
def kernel() -> None:
    line = ops.build(["quantize"])["quantize"]
    assert line.startswith("loaded"), line


@pytest.fixture(params=["best", "generic"])
def isa(request: pytest.FixtureRequest, kernel: None) -> str:
    """Each compiled variant (AVX2 and baseline on x86-64)."""
    used = ops.use_quantize_isa(-1 if request.param == "best" else 0)
    yield used
    ops.use_quantize_isa(-1)


def _hard_input(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of very different ranges, an all-zero block, negative zeros and exact ties between two steps."""
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.logspace(-6, 3, numel).flip(0)
    if numel > 2 * BLOCK:
        x[BLOCK:2 * BLOCK] = 0.0
        x[BLOCK + 3] = -0.0
        tie = x[2 * BLOCK:3 * BLOCK]  # scale exactly 1: k + 0.5 must round half to even, both signs
        tie.copy_(torch.arange(BLOCK, dtype=torch.float32) % 256 - 127.5)
        tie[0] = 127.0
    return x.to(dtype)


def _torch_codec(x: torch.Tensor) -> Quantized:
    out = Quantized.empty(x.numel(), x.device)
    codec.torch_quantize(x, out)
    return out


def test_the_quantize_kernel_builds(kernel: None) -> None:
    assert ops.status()["quantize"].startswith("loaded")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", SIZES)
def test_the_kernel_quantizes_to_torchs_bits(isa: str, numel: int, dtype: torch.dtype) -> None:
    x = _hard_input(numel, dtype)
    ours, reference = codec.quantize(x), _torch_codec(x)
    assert torch.equal(ours.scales, reference.scales)
    assert torch.equal(ours.values, reference.values)  # the last block's padding included: zeros in both


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kernel_dequantizes_and_accumulates_to_torchs_bits(isa: str, dtype: torch.dtype) -> None:
    numel = 3 * BLOCK + 77
    q = _torch_codec(_hard_input(numel, torch.float32))
    ours = codec.dequantize_into(q, torch.empty(numel, dtype=dtype))
    reference = torch.empty(numel, dtype=dtype)
    assert ops.dequantize_blocks(q.values, q.scales, reference, BLOCK)  # the kernel wrote `ours` too
    torch_path = (q.values.float() * q.scales[:, None]).view(-1)[:numel].to(dtype)
    assert torch.equal(ours, torch_path) and torch.equal(reference, torch_path)

    base = torch.randn(numel)
    summed = codec.dequantize_add(q, base.clone())
    assert torch.equal(summed, base + (q.values.float() * q.scales[:, None]).view(-1)[:numel])


def test_many_threads_give_the_same_bits(kernel: None) -> None:
    x = _hard_input(64 * BLOCK + 5, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        wide = codec.quantize(x)
        torch.set_num_threads(1)
        narrow = codec.quantize(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(wide.values, narrow.values) and torch.equal(wide.scales, narrow.scales)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_block_with_an_inf_or_nan_dequantizes_to_nans_and_leaves_the_others_alone(isa: str, bad: float) -> None:
    x = _hard_input(3 * BLOCK + 77, torch.float32)
    x[BLOCK + 10] = bad
    for q in (codec.quantize(x), _torch_codec(x)):
        back = codec.dequantize_into(q, torch.empty_like(x))
        assert back[BLOCK:2 * BLOCK].isnan().all()
        others = torch.cat([back[:BLOCK], back[2 * BLOCK:]])
        assert others.isfinite().all()
    kernel_back = codec.dequantize_into(codec.quantize(x), torch.empty_like(x))
    torch_back = codec.dequantize_into(_torch_codec(x), torch.empty_like(x))
    assert torch.equal(kernel_back[:BLOCK], torch_back[:BLOCK])


def test_without_the_kernel_the_codec_runs_on_torch_with_the_same_bits(kernel: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    x = _hard_input(3 * BLOCK + 77, torch.float32)
    with_kernel = codec.quantize(x)
    monkeypatch.setenv("ZERORUN_KERNELS", "off")
    monkeypatch.setattr(ops, "_loaded", {})
    assert not ops.quantize_blocks(x, torch.empty(0, dtype=torch.int8), torch.empty(0), BLOCK)
    without = codec.quantize(x)
    assert torch.equal(with_kernel.values, without.values) and torch.equal(with_kernel.scales, without.scales)


def test_tensors_the_kernel_cannot_take_go_to_torch(kernel: None) -> None:
    q = codec.quantize(torch.randn(BLOCK + 3))
    strided = torch.empty(2 * (BLOCK + 3))[::2]
    assert not ops.dequantize_blocks(q.values, q.scales, strided, BLOCK)
    assert not ops.dequantize_blocks(q.values, q.scales, torch.empty(BLOCK + 3, dtype=torch.bfloat16), BLOCK,
                                     accumulate=True)
    assert torch.equal(codec.dequantize_into(q, strided), codec.dequantize_into(q, torch.empty(BLOCK + 3)))


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: runs on a GPU machine")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [*SIZES, 1_000_003])
def test_the_cuda_kernel_quantizes_to_the_cpu_codecs_bits(numel: int, dtype: torch.dtype) -> None:
    """kernels/quantize.cu against the CPU codec (kernel or torch) and torch's path on the GPU: a GPU rank and a CPU
    rank send and compute the same values."""
    assert ops.build(["quantize_cuda"])["quantize_cuda"].startswith("loaded")
    x = _hard_input(numel, dtype)
    on_gpu, on_cpu, torch_gpu = codec.quantize(x.cuda()), codec.quantize(x), _torch_codec(x.cuda())
    for q in (on_gpu, torch_gpu):
        assert torch.equal(q.scales.cpu(), on_cpu.scales) and torch.equal(q.values.cpu(), on_cpu.values)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        back = codec.dequantize_into(on_gpu, torch.empty(numel, dtype=out_dtype, device="cuda"))
        assert torch.equal(back.cpu(), codec.dequantize_into(on_cpu, torch.empty(numel, dtype=out_dtype)))
    base = torch.randn(numel)
    summed = codec.dequantize_add(on_gpu, base.cuda())
    assert torch.equal(summed.cpu(), codec.dequantize_add(on_cpu, base.clone()))


@needs_gpu
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_cuda_block_with_an_inf_or_nan_dequantizes_to_nans(bad: float) -> None:
    x = _hard_input(3 * BLOCK + 77, torch.float32)
    x[BLOCK + 10] = bad
    back = codec.dequantize_into(codec.quantize(x.cuda()), torch.empty(x.numel(), device="cuda")).cpu()
    assert back[BLOCK:2 * BLOCK].isnan().all() and torch.cat([back[:BLOCK], back[2 * BLOCK:]]).isfinite().all()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_kernel_gives_the_same_bits_from_and_into_unaligned_views(dtype: torch.dtype) -> None:
    """Whole blocks take 16-byte loads where the pointers allow; a view one element in takes the element-wise
    form, which must give the same bits (a piece of a flat buffer can start anywhere)."""
    numel = 5 * BLOCK + 9
    x = _hard_input(numel + 1, dtype)
    expected = codec.quantize(x[1:].clone())
    q = codec.quantize(x.cuda()[1:])
    assert torch.equal(q.scales.cpu(), expected.scales) and torch.equal(q.values.cpu(), expected.values)
    back = codec.dequantize_into(q, torch.zeros(numel + 1, device="cuda")[1:])
    assert torch.equal(back.cpu(), codec.dequantize_into(expected, torch.empty(numel)))
    base = torch.randn(numel + 1)
    summed = codec.dequantize_add(q, base.cuda()[1:])
    assert torch.equal(summed.cpu(), codec.dequantize_add(expected, base[1:].clone()))
