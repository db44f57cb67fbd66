"""The CUDA kernel: `kernels/fused_adam.cu` compiles with plain nvcc wherever the toolkit is (CI has
it without a GPU), and on a GPU computes torch's Adam(W) with an exact low-precision copy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from zerorun import ops

NVCC = shutil.which("nvcc")
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device: GPU numerics run on a GPU machine")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: install the CUDA toolkit to compile-check fused_adam.cu")
def test_fused_adam_compiles_with_nvcc(tmp_path: Path) -> None:
    """The kernel has no torch headers, so this is the whole translation unit ops.py builds."""
    source = ops.sources_dir() / "fused_adam.cu"
    command = [NVCC, "-c", *ops.SPECS["fused_adam"].cuda_cflags, "-arch=sm_80", "-Xcompiler", "-Wall",
               "-I", str(ops.sources_dir()), str(source), "-o", str(tmp_path / "fused_adam.o")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}{result.stderr}"
    assert "warning" not in result.stderr.lower(), result.stderr
    assert (tmp_path / "fused_adam.o").stat().st_size > 0


@needs_gpu
def test_cuda_kernel_builds() -> None:
    line = ops.build(["fused_adam"])["fused_adam"]
    assert line.startswith("loaded"), line


@needs_gpu
@pytest.mark.parametrize("numel", [1, 7, 1023, 100003])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_cuda_kernel_matches_torch_optim_and_copies_exactly(numel: int, decoupled: bool, offset: int) -> None:
    """offset=1 starts every tensor one element into its buffer: the one-element-per-thread path."""
    assert ops.build(["fused_adam"])["fused_adam"].startswith("loaded")
    torch.manual_seed(numel)
    device = torch.device("cuda")

    def flat(dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(numel + offset, dtype=dtype, device=device)[offset:]

    params, exp_avg, exp_avg_sq, copy = flat(), flat(), flat(), flat(torch.bfloat16)
    params.copy_(torch.randn(numel))
    reference = params.detach().clone().requires_grad_()
    optimizer_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_class([reference], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                weight_decay=HYPER["weight_decay"], foreach=False)
    for step in range(1, 6):
        grads = flat(torch.float16)
        grads.copy_(torch.randn(numel) * 3)
        reference.grad = grads.float() / 8.0
        optimizer.step()
        ops.adamw_step(params, grads, exp_avg, exp_avg_sq, step=step, decoupled=decoupled, grad_divisor=8.0,
                       lowp_out=copy, **HYPER)
    torch.cuda.synchronize()
    torch.testing.assert_close(params, reference.detach(), rtol=1e-6, atol=3e-7)
    assert torch.equal(copy, params.to(torch.bfloat16))


def _adam_states(impl: str, p0: torch.Tensor, grads: list[torch.Tensor], decoupled: bool) -> list[torch.Tensor]:
    """(params, exp_avg, exp_avg_sq) after len(grads) steps of one AdamW implementation from p0."""
    if impl == "zerorun":
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for step, g in enumerate(grads, 1):
            ops.adamw_step(p, g.clone(), m, v, step=step, decoupled=decoupled, **HYPER)
        return [p, m, v]
    dtype = torch.float64 if impl == "float64" else torch.float32
    device = "cpu" if impl == "torch fused (CPU)" else p0.device
    ref = p0.to(device, dtype).clone().requires_grad_()
    kind = {"float64": dict(foreach=False), "torch foreach": dict(foreach=True), "torch for-loop": dict(foreach=False),
            "torch fused": dict(fused=True), "torch fused (CPU)": dict(fused=True)}[impl]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([ref], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], **kind)
    for g in grads:
        ref.grad = g.to(device, dtype)
        opt.step()
    state = opt.state[ref]
    return [t.detach().to(p0.device, torch.float64) for t in (ref, state["exp_avg"], state["exp_avg_sq"])]


@needs_gpu
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_cuda_kernel_is_as_close_to_float64_as_torch(decoupled: bool) -> None:
    """Against Adam(W) in float64 (torch's for-loop on float64 tensors), our kernel's parameters and
    moments are at least as close as each of torch's fp32 implementations on the GPU (foreach,
    for-loop, fused), within 2x of the closest. torch's CUDA fused kernel is not our bit-for-bit reference: it
    rounds (1 - beta2) in fp32, 1.29e-5 off for beta2 = 0.999, so its exp_avg_sq runs 1.3e-5
    relative apart from every other implementation; ours matches torch's CPU fused kernel."""
    assert ops.build(["fused_adam"])["fused_adam"].startswith("loaded")
    gen = torch.Generator(device="cuda").manual_seed(11)
    n, steps = 1_000_003, 30
    p0 = torch.randn(n, device="cuda", generator=gen)
    grads = [torch.randn(n, device="cuda", generator=gen) for _ in range(steps)]
    exact = _adam_states("float64", p0, grads, decoupled)
    names = ("params", "exp_avg", "exp_avg_sq")
    errors = {}
    for impl in ("zerorun", "torch foreach", "torch for-loop", "torch fused", "torch fused (CPU)"):
        states = _adam_states(impl, p0, grads, decoupled)
        errors[impl] = [((s.double() - e).abs().max() / e.abs().max()).item() for s, e in zip(states, exact)]
        print(f"{impl:<18} " + "  ".join(f"{k} {v:.2e}" for k, v in zip(names, errors[impl])))
    for i, name in enumerate(names):
        best_torch_gpu = min(errors[impl][i] for impl in ("torch foreach", "torch for-loop", "torch fused"))
        assert errors["zerorun"][i] <= 2 * best_torch_gpu + 1e-12, (name, errors)
