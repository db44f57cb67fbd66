"""Every collective the engine issues on a GPU, checked on CPU ranks: CUDA paths CPU-only development cannot break.

The ranks run under `cuda_standin.pretend_cuda`: the engine believes it holds CUDA tensors (its flat
buffers, gradients, shards and parameters say `cuda`), and the process group behind `torch.distributed`
refuses what the real backend refuses (gloo: point to point of CUDA tensors; NCCL: host
tensors). Each case trains twice on the same ranks, on plain CPU and on the pretended GPU, and the two
must agree: over gloo bit for bit (CUDA tensors are staged to host memory and take the host's very
algorithms), over NCCL to fp32 rounding (the stand-in's reduce-scatter is gloo's all-reduce underneath,
which adds in another order than zerorun's host collectives; measured: 0 with 2 ranks, 1.2e-7 relative
with 3, 1.1e-7 with 2 nodes x 2, against a 1e-5 bound, far below a wrong step: a skipped one moves a
weight by up to lr = 3e-3, tests/runtime/test_engine_precision.py).

This is the test that would have caught the pairwise gloo collectives sending CUDA tensors point to
point (gloo's `writev ... Bad address` on a GPU): on that code every gloo case here fails with the
stand-in's "gloo refuses dist.isend of a cuda tensor".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.reference import engine_run

STEPS, ACCUM = 3, 2
NCCL_RTOL = 1e-5

FLAT = {  # every rank on one node
    "stage 0": ["zero.stage=0"],
    "stage 1": ["zero.stage=1"],
    "stage 1, publish overlapped": ["zero.stage=1", "zero.overlap_publish=true"],
    "stage 2": ["zero.stage=2"],
    "stage 2, bf16": ["zero.stage=2", "precision.dtype=bf16"],
    "stage 2, fp16, clipped": ["zero.stage=2", "precision.dtype=fp16", "train.clip_grad_norm=0.05"],
    "stage 3": ["zero.stage=3"],
    "stage 3, bf16, prefetch 2": ["zero.stage=3", "precision.dtype=bf16", "zero.prefetch_units=2"],
    "stage 2, optimizer on CPU": ["zero.stage=2", "zero.offload_optimizer.device=cpu"],
    "stage 3, optimizer and parameters on CPU": ["zero.stage=3", "zero.offload_optimizer.device=cpu",
                                                  "zero.offload_param.device=cpu"],
    "stage 2, gloo's own wire (no shared memory)": ["zero.stage=2", "zero.cpu_collectives=gloo"],
    "stage 3, gloo's own wire": ["zero.stage=3", "zero.cpu_collectives=gloo"],
}
ZERO_PLUS_PLUS = {  # one algorithm, two wires: point to point on gloo, all-to-all and all-gather on NCCL
    "stage 2, qgZ + qwZ": ["zero.stage=2", "zero.cpu_collectives=gloo", "zero.quantized_gradients=true",
                           "zero.quantized_weights=true"],
    "stage 3, qgZ + qwZ": ["zero.stage=3", "zero.cpu_collectives=gloo", "zero.quantized_gradients=true",
                           "zero.quantized_weights=true"],
}
NODES = {  # 2 nodes x 2 ranks: the hierarchy (gloo) and hpZ
    "stage 2, two levels": ["zero.stage=2"],
    "stage 3, two levels, hpZ": ["zero.stage=3", "zero.hpz_partition_size=2"],
    "stage 3, two levels, qgZ + qwZ": ["zero.stage=3", "zero.quantized_gradients=true",
                                       "zero.quantized_weights=true"],
}


def _train(rank: int, overrides: list[str]) -> tuple[list[float], dict[str, torch.Tensor], set[str]]:
    """Losses, final parameters, and where the engine believes its compute and parameters are."""
    run, engine = engine_run(rank, STEPS, ACCUM, overrides)
    engine.store.settle()
    devices = {engine.device.type, next(engine.module.parameters()).device.type}
    return run.losses, {name: p.cpu().as_subclass(torch.Tensor) for name, p in run.params.items()}, devices


def _both(rank: int, world: int, backends: tuple[str, ...], cases: dict[str, list[str]],
          per_node: int | None) -> dict[str, dict]:
    """Each case on plain CPU, then on the pretended GPU over each backend: per backend, {case: (loss, parameter
    differences, devices believed)}, and under "calls" the (torch.distributed call, device) pairs its runs made."""
    from tests.runtime.cuda_standin import pretend_cuda

    if per_node:
        os.environ.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(rank % per_node))
    out: dict[str, dict] = {backend: {"calls": set()} for backend in backends}
    for name, overrides in cases.items():  # the first CPU run starts the process group (gloo); pretend_cuda then
        cpu = _train(rank, overrides)      # reports each backend
        for backend in backends:
            with pretend_cuda(backend) as seen:
                gpu = _train(rank, overrides)
            out[backend]["calls"] |= seen
            out[backend][name] = (*_differences(cpu, gpu), gpu[2])
    return out


_RUNS: dict[tuple[int, str], list[dict]] = {}  # (world, cases) -> every rank's results, for both backends' tests


def _runs(world: int, cases: str, backend: str) -> list[dict]:
    """The ranks' results of `cases` (FLAT with ZERO_PLUS_PLUS, or NODES) over `backend`: both backends in one call
    of the ranks, each case's CPU run shared by the gloo and the NCCL test."""
    key = (world, cases)
    if key not in _RUNS:
        matrix, per_node = ({**FLAT, **ZERO_PLUS_PLUS}, None) if cases == "flat" else (NODES, 2)
        _RUNS[key] = run_ranks(_both, world, (("gloo", "nccl"), matrix, per_node), timeout=900)
    return [dict(result[backend]) for result in _RUNS[key]]


def _differences(cpu: tuple, gpu: tuple) -> tuple[float, float]:
    losses = torch.tensor(gpu[0], dtype=torch.float64), torch.tensor(cpu[0], dtype=torch.float64)
    loss_rel = ((losses[0] - losses[1]).abs() / losses[1].abs()).max().item()
    param_rel = max(((gpu[1][n].double() - p.double()).abs().max() / p.double().abs().max().clamp_min(1e-12)).item()
                    for n, p in cpu[1].items())
    return loss_rel, param_rel


def _check(results: list[dict], backend: str) -> set[tuple[str, str]]:
    problems, calls = [], set()
    for rank, result in enumerate(results):
        calls |= result.pop("calls")
        for name, (loss_rel, param_rel, devices) in result.items():
            assert devices == {"cuda"}, f"{name}: the engine did not believe it was on a GPU: {devices}"
            bound = 0.0 if backend == "gloo" else NCCL_RTOL
            if loss_rel > bound or param_rel > bound:
                problems.append(f"rank {rank} {name}: losses {loss_rel:.2e}, parameters {param_rel:.2e} "
                                f"relative (bound {bound:.0e})")
    assert not problems, "\n".join(problems)
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_stage_on_gpus_sharing_gloo_matches_the_cpu_bit_for_bit(world: int) -> None:
    calls = _check(_runs(world, "flat", "gloo"), "gloo")
    assert ("isend", "cpu") in calls and ("irecv", "cpu") in calls, calls  # the pairwise wire ran, on host copies
    assert not {call for call in calls if call[1] == "cuda"} - {("all_reduce", "cuda"), ("broadcast", "cuda")}, calls


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_every_stage_on_nccl_matches_the_cpu(world: int) -> None:
    calls = _check(_runs(world, "flat", "nccl"), "nccl")
    assert {("reduce_scatter_tensor", "cuda"), ("all_gather_into_tensor", "cuda"), ("all_reduce", "cuda"),
            ("all_to_all_single", "cuda")} <= calls  # the last: qgZ's exchange


@pytest.mark.slow
def test_two_levels_and_hpz_on_gpus_sharing_gloo_match_the_cpu() -> None:
    calls = _check(_runs(4, "nodes", "gloo"), "gloo")
    assert ("isend", "cpu") in calls, calls  # the cross-node level's pairwise wire, on host copies


@pytest.mark.slow
def test_two_levels_hpz_and_zero_plus_plus_on_nccl_match_the_cpu() -> None:
    calls = _check(_runs(4, "nodes", "nccl"), "nccl")
    assert ("all_to_all_single", "cuda") in calls  # the cross-node level's int8 exchange


def test_a_gpu_step_over_either_wire_takes_only_what_its_backend_carries() -> None:
    """The development tier's share of the above (the full matrix is slow): stage 2 over gloo's own wire and stage 3
    with qgZ + qwZ, each on 2 ranks believing they hold CUDA tensors, over gloo and over NCCL."""
    cases = {"stage 2, gloo's own wire": FLAT["stage 2, gloo's own wire (no shared memory)"],
             "stage 3, qgZ + qwZ": ZERO_PLUS_PLUS["stage 3, qgZ + qwZ"]}
    results = run_ranks(_both, 2, (("gloo", "nccl"), cases, None), timeout=600)
    for backend in ("gloo", "nccl"):
        _check([result[backend] for result in results], backend)


def _refusals(rank: int, world: int, backend: str) -> str:
    import torch.distributed as dist

    from tests.runtime.cuda_standin import Refused, pretend_cuda
    from zerorun.runtime.comm.dist import init_distributed

    os.environ["ZERORUN_BACKEND"] = backend
    with pretend_cuda(backend):
        init_distributed()
        wrong = torch.zeros(4, device="cuda") if backend == "gloo" else torch.zeros(4)
        try:
            dist.isend(wrong, dst=1 - rank) if backend == "gloo" else dist.all_reduce(wrong)
        except Refused as refused:
            return str(refused)
    return "not refused"


@pytest.mark.parametrize("backend, expected", [
    ("gloo", "gloo refuses dist.isend of a cuda tensor"),
    ("nccl", "nccl refuses dist.all_reduce of a cpu tensor"),
])
def test_the_standin_refuses_what_the_real_backend_refuses(backend: str, expected: str) -> None:
    for message in run_ranks(_refusals, 2, (backend,)):
        assert expected in message, message


def _adam_on_pretended_cuda(rank: int, world: int) -> tuple[str, list[float]]:
    from tests.runtime.cuda_standin import pretend_cuda
    from zerorun import ops

    class Launched:  # a CUDA Adam kernel that built: on torch's CUDA build, nvcc and a cached build suffice
        def zr_cuda_adam(self, *args: object) -> int:
            raise AssertionError("zerorun's CUDA kernel ran on the stand-in's host memory")

    ops._loaded["fused_adam"] = ops.LoadedKernel(Launched(), "")  # loaded before the stand-in (or built inside it)
    real_open, real_build = ops._open, ops.build_or_wait
    ops._open, ops.build_or_wait = (lambda kind, path: Launched()), (lambda *args, **kwargs: (Path("x"), None))
    try:
        with pretend_cuda("gloo"):
            params, grads, m, v = (torch.full((8,), value, device="cuda") for value in (1.0, 0.5, 0.0, 0.0))
            ops.adamw_step(params, grads, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
            reason = ops.load_kernel("fused_adam").reason
            return reason, params.cpu().tolist()
    finally:
        ops._open, ops.build_or_wait = real_open, real_build


def test_the_standin_runs_the_fallbacks_of_zeroruns_cuda_kernels_whatever_torch_is_installed() -> None:
    """Issue 57: with torch's CUDA build on a CPU machine, the stand-in's fake CUDA tensors reached zerorun's real
    CUDA kernel ("CUDA driver version is insufficient"): only the CPU build of torch made the test pass."""
    (reason, params), = run_ranks(_adam_on_pretended_cuda, 1)
    assert reason == "the CUDA stand-in has no GPU to run it (its fallback runs)"
    assert params == pytest.approx([0.9] * 8)  # Adam's first step: lr x sign(grad)
