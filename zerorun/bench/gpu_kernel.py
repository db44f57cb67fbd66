"""The CUDA Adam kernel checked on a GPU: its numerics against references, its bandwidth against a copy.

`numerics(device)` runs `ops.adamw_step` (zerorun's kernel for that device) against two references
on the same inputs, step by step: torch's *CPU* fused AdamW, whose arithmetic `kernels/adam.h`
follows operation for operation, and an Adam(W) in float64. torch's CUDA fused AdamW is not a
reference: it rounds `1 - beta2` in fp32, so its second moments sit 1.3e-5 relative away from
every other implementation (docs/gpu.md, "Accuracy"). Cases cover fp32/bf16/fp16 gradients, the
bf16/fp16 copy-out, sizes around the vector width, misaligned views, Adam with L2, gradient
divisors, and (memory allowing) 1e8+ elements. With `device="cpu"` the same cases run the CPU
kernel, which is how the tests keep this module honest on a machine without a GPU.

`bandwidth()` times the update against torch's fused AdamW and a device-to-device copy (the
roofline), in GB/s of the bytes the update must move (28 per parameter, 30 with the copy-out).
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from zerorun import ops

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)  # big lr/wd: a wrong term shows
LOWP = {"bf16": torch.bfloat16, "fp16": torch.float16}
GRAD = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    name: str
    numel: int
    steps: int
    grad: str = "fp32"
    lowp: str | None = "bf16"
    decoupled: bool = True
    divisor: float = 8.0
    offset: int = 0  # > 0: every tensor starts this many elements into its buffer (misaligned)


@dataclass(frozen=True)
class CaseResult:
    case: Case
    vs_cpu_fused: float  # largest |difference| of the parameters over their largest |value|
    vs_float64: float
    moments_rel: float  # largest relative difference of either moment against the CPU fused AdamW's
    copy_exact: bool  # the low-precision copy is exactly the cast of the updated parameters
    tolerance: float

    @property
    def ok(self) -> bool:
        return (self.vs_cpu_fused <= self.tolerance and self.vs_float64 <= self.tolerance
                and self.moments_rel <= 1e-5 and self.copy_exact)


def cases(max_numel: int) -> list[Case]:
    out = []
    for numel in (1, 3, 4, 5, 7, 1023, 4097, 65539, 1_000_003):
        out += [Case("adamw fp32 grads, bf16 copy", numel, 20), Case("misaligned", numel, 10, offset=1)]
    out += [Case("adamw bf16 grads", 1_000_003, 20, grad="bf16"),
            Case("adamw bf16 grads, misaligned", 1_000_003, 10, grad="bf16", offset=1),
            Case("adamw fp16 grads, fp16 copy", 1_000_003, 20, grad="fp16", lowp="fp16"),
            Case("adamw, no copy", 1_000_003, 20, lowp=None),
            Case("divisor 1.0", 100_003, 10, divisor=1.0),
            Case("divisor 1.37 (clipping)", 100_003, 10, divisor=1.37),
            Case("adam (L2)", 1_000_003, 20, decoupled=False),
            Case("adam (L2), fp16", 100_003, 10, decoupled=False, grad="fp16", lowp="fp16"),
            Case("1e8+ elements", 100_000_007, 5)]
    return [c for c in out if c.numel <= max_numel]


def _float64_adam(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, step: int,
                  decoupled: bool) -> None:
    h = HYPER
    if decoupled:
        p.mul_(1 - h["lr"] * h["weight_decay"])
    else:
        g = g + h["weight_decay"] * p
    m.mul_(h["beta1"]).add_(g, alpha=1 - h["beta1"])
    v.mul_(h["beta2"]).addcmul_(g, g, value=1 - h["beta2"])
    denom = (v / (1 - h["beta2"] ** step)).sqrt_().add_(h["eps"])
    p.addcdiv_(m, denom, value=-h["lr"] / (1 - h["beta1"] ** step))


def run_case(case: Case, device: torch.device, seed: int = 0) -> CaseResult:
    """The kernel and both references through `case.steps` updates of the same random gradients."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def flat(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(case.numel + case.offset, dtype=dtype, device=device)[case.offset:]

    p, m, v = flat(torch.float32), flat(torch.float32), flat(torch.float32)
    p.normal_(generator=gen)
    copy = flat(LOWP[case.lowp]) if case.lowp else None
    grads = flat(GRAD[case.grad])
    ref = p.detach().cpu().clone().requires_grad_(True)
    cls = torch.optim.AdamW if case.decoupled else torch.optim.Adam
    opt = cls([ref], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], fused=True)
    p64, m64, v64 = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for step in range(1, case.steps + 1):
        grads.normal_(generator=gen)
        g32 = grads.float() / case.divisor
        ref.grad = g32.cpu()
        opt.step()
        _float64_adam(p64, m64, v64, g32.double(), step, case.decoupled)
        ops.adamw_step(p, grads, m, v, step=step, decoupled=case.decoupled, grad_divisor=case.divisor,
                       lowp_out=copy, **HYPER)
    state = opt.state[ref]
    r = ref.detach().to(device)
    scale = max(1.0, r.abs().max().item())
    moments = max(((m - state["exp_avg"].to(device)).abs().max() / state["exp_avg"].abs().max().clamp_min(1e-30)).item(),
                  ((v - state["exp_avg_sq"].to(device)).abs().max()
                   / state["exp_avg_sq"].abs().max().clamp_min(1e-30)).item())
    return CaseResult(
        case, vs_cpu_fused=(p - r).abs().max().item() / scale,
        vs_float64=(p.double() - p64).abs().max().item() / scale, moments_rel=moments,
        copy_exact=copy is None or torch.equal(copy, p.to(copy.dtype)),
        # ulp-level differences grow by about an ulp of |p| a step; a wrong term (bias correction, eps,
        # decay, divisor, a dtype decoded wrongly) is >= 1e-4 of |p| within a few steps at lr 1e-2
        tolerance=1e-6 + 3e-7 * case.steps)


def numerics(device: torch.device, max_numel: int = 10**12) -> list[CaseResult]:
    """Every case on `device`; a kernel that silently fell back to torch would make this vacuous, so
    its warning is an error here."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ops.KernelWarning)
        results = []
        for case in cases(max_numel):
            if device.type == "cuda" and torch.cuda.mem_get_info(device)[0] < case.numel * 48:
                continue  # fp32 state, the float64 reference and the CPU copy: skip what does not fit
            results.append(run_case(case, device))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return results


def _seconds(fn: object, iters: int = 20, reps: int = 5) -> float:
    for _ in range(3):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()  # type: ignore[operator]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def bandwidth(numel: int = 1 << 27) -> dict[str, float]:
    """GB/s per implementation over `numel` parameters, and the device-to-device copy's."""
    dev = torch.device("cuda")
    p = torch.randn(numel, device=dev)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    g = torch.randn(numel, device=dev)
    out16 = torch.empty(numel, dtype=torch.bfloat16, device=dev)
    h: dict[str, Any] = dict(HYPER, lr=1e-3, weight_decay=0.01)
    ref = p.clone().requires_grad_(True)
    ref.grad = g.clone()
    opt = torch.optim.AdamW([ref], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                            weight_decay=h["weight_decay"], fused=True)
    rates = {
        "zerorun": numel * 28 / _seconds(lambda: ops.adamw_step(p, g, m, v, step=10, **h)) / 1e9,
        "zerorun + bf16 copy": numel * 30 / _seconds(lambda: ops.adamw_step(p, g, m, v, step=10, lowp_out=out16,
                                                                          **h)) / 1e9,
        "torch AdamW(fused=True)": numel * 28 / _seconds(opt.step) / 1e9,
    }
    del ref, opt
    src = torch.empty(numel, device=dev)
    dst = torch.empty_like(src)
    rates["device-to-device copy"] = 2 * numel * 4 / _seconds(lambda: dst.copy_(src)) / 1e9
    return rates
