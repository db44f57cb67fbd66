"""qgZ: block int8 keeps each element within half a step of its block's scale; a quantized reduce-scatter
sums close to the exact one on every rank, and training stays within 2% of exact losses."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks, run_threads
from zerorun.runtime.comm.quantize import BLOCK, Quantized, dequantize_add, quantize


def test_each_element_comes_back_within_half_a_step_of_its_own_blocks_scale():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3 * BLOCK + 77, generator=gen)
    x[:BLOCK] *= 1e-4  # a block of tiny gradients next to large ones keeps its own precision
    q = quantize(x)
    back = dequantize_add(q, torch.zeros_like(x))
    step = q.scales.repeat_interleave(BLOCK)[: x.numel()]
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert (back[:BLOCK] - x[:BLOCK]).abs().max() < 1e-5  # the large blocks' half step is ~1e-2
    assert q.nbytes() < x.numel() * 4 / 3.9  # a quarter of fp32, plus the scales


def test_zeros_and_a_bf16_input_round_trip():
    assert torch.equal(dequantize_add(quantize(torch.zeros(10)), torch.zeros(10)), torch.zeros(10))
    x = torch.linspace(-1, 1, 300).to(torch.bfloat16)
    assert torch.allclose(dequantize_add(quantize(x), torch.zeros(300)), x.float(), atol=1 / 127)
    assert Quantized.empty(BLOCK + 1).values.shape == (2, BLOCK)


def _reduce_scatter(rank: int, world: int) -> tuple[list[float], list[float], float]:
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    full = torch.randn(world * 5000, generator=torch.Generator().manual_seed(rank))
    exact, quantized = torch.empty(5000), torch.empty(5000)
    Collectives(cpu="gloo").reduce_scatter(full.clone(), exact).wait()
    Collectives(cpu="gloo", quantized_gradients=True).reduce_scatter(full.clone(), quantized).wait()
    bound = sum(full.abs().max().item() / 127 / 2 for _ in range(world - 1))  # half a step per peer's piece
    return exact.tolist(), quantized.tolist(), bound


@pytest.mark.parametrize("world", [2, 3])
def test_a_quantized_reduce_scatter_is_within_half_a_step_per_peer_of_the_exact_one(world):
    for exact, quantized, bound in run_threads(_reduce_scatter, world):
        error = (torch.tensor(exact) - torch.tensor(quantized)).abs().max().item()
        assert 0 < error <= 2 * bound  # the peers' bounds, each from its own data (< 2x ours here)


def _chunked(rank: int, world: int) -> dict[str, list[list[float]]]:
    """Each quantized collective on gloo's point-to-point wire twice: in one chunk, and in chunks of one block
    (six, more than the codec keeps on the wire at once), so the pipeline's lag and its last chunks run."""
    from zerorun.runtime.comm import collectives, pairwise
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    numel = 5 * BLOCK + 100  # per rank: a last chunk shorter than a block
    full = torch.randn(world * numel, generator=torch.Generator().manual_seed(rank))
    start = torch.randn(numel, generator=torch.Generator().manual_seed(10 + rank))
    results: dict[str, list[list[float]]] = {}
    for chunk in (pairwise.CODEC_CHUNK, BLOCK):
        pairwise.CODEC_CHUNK = chunk
        comm = collectives.Collectives(cpu="gloo", quantized_gradients=True, quantized_weights=True)
        direct, added, narrow = torch.empty(numel), start.clone(), torch.empty(numel, dtype=torch.bfloat16)
        comm.reduce_scatter(full.clone(), direct).wait()
        comm.reduce_scatter(full.clone(), added, accumulate=True).wait()
        comm.reduce_scatter(full.clone(), narrow).wait()
        gathered = full.clone()
        comm.all_gather(gathered, compute_copy=True).wait()
        for name, value in (("direct", direct), ("added", added), ("bf16", narrow), ("gathered", gathered)):
            results.setdefault(name, []).append(value.float().tolist())
    return results


def test_the_codec_pipeline_gives_the_same_bits_in_any_number_of_chunks():
    for results in run_ranks(_chunked, 3):  # rank processes: each sets the codec's chunk for its process
        for name, (whole, chunked) in results.items():
            assert torch.equal(torch.tensor(whole), torch.tensor(chunked)), name


def _losses(rank: int, world: int) -> tuple[list[float], list[float]]:
    from tests.runtime.reference import engine_run
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    exact, _ = engine_run(rank, 20, 2, ["zero.stage=2", "zero.cpu_collectives=gloo"], None)
    quantized, _ = engine_run(rank, 20, 2, ["zero.stage=2", "zero.cpu_collectives=gloo",
                                            "zero.quantized_gradients=true"], None)
    return exact.losses, quantized.losses


def test_training_with_quantized_gradients_stays_within_two_percent_of_exact_losses():
    exact, quantized = (torch.tensor(x) for x in run_threads(_losses, 3)[0])
    assert not torch.equal(exact, quantized)  # the quantized path really ran
    assert ((quantized - exact).abs() / exact.abs()).max() < 0.02


def _gather(rank: int, world: int) -> list[float]:
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    full = torch.zeros(world * 3000)
    full.view(world, -1)[rank] = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    comm = Collectives(cpu="gloo", quantized_weights=True)
    comm.all_gather(full, compute_copy=True).wait()
    comm.all_gather(full.clone()).wait()  # a buffer that is stored back: exact
    return full.tolist(), comm.stats.level_bytes()["network"]


def test_a_quantized_gather_gives_every_rank_the_same_weights_close_to_each_owners():
    runs = run_threads(_gather, 3)
    gathered = [torch.tensor(x) for x, _ in runs]
    quantized = 3 * 3000 + 4 * 3 * 2  # int8 values, and a scale per block of each rank's 3000-element piece
    assert all(network == quantized + 3 * 3000 * 4 for _, network in runs)  # the telemetry counts what crossed
    assert all(torch.equal(g, gathered[0]) for g in gathered)  # the owner's piece too: replicas agree
    exact = torch.cat([torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(3)])
    assert 0 < (gathered[0] - exact).abs().max() <= exact.abs().max() / 127 / 2 * 1.001


def _stage3_losses(rank: int, world: int) -> tuple[list[float], list[float]]:
    from tests.runtime.reference import engine_run
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    base = ["zero.stage=3", "zero.cpu_collectives=gloo"]
    exact, _ = engine_run(rank, 20, 2, base, None)
    quantized, _ = engine_run(rank, 20, 2, [*base, "zero.quantized_weights=true", "zero.quantized_gradients=true"],
                              None)
    return exact.losses, quantized.losses


@pytest.mark.slow
def test_stage_3_with_quantized_weights_and_gradients_stays_within_two_percent_of_exact_losses():
    exact, quantized = (torch.tensor(x) for x in run_threads(_stage3_losses, 3)[0])
    assert not torch.equal(exact, quantized)
    assert ((quantized - exact).abs() / exact.abs()).max() < 0.02


def _stage2_run(rank: int, world: int) -> tuple[list[float], list[float], dict, dict]:
    from tests.runtime.reference import engine_run
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    base = ["zero.stage=2", "zero.cpu_collectives=gloo"]
    exact, _ = engine_run(rank, 20, 2, base, None)
    quantized, engine = engine_run(rank, 20, 2, [*base, "zero.quantized_weights=true",
                                                  "zero.quantized_gradients=true"], None)
    computed = {n: p.detach().tolist() for n, p in engine.module.named_parameters()}  # lists: tensors cannot leave
    return exact.losses, quantized.losses, computed, {n: p.tolist() for n, p in quantized.params.items()}


@pytest.mark.slow
def test_stage_2_with_quantized_publish_stays_within_two_percent_and_keeps_an_exact_master():
    runs = run_threads(_stage2_run, 3)
    exact, quantized = torch.tensor(runs[0][0]), torch.tensor(runs[0][1])
    assert not torch.equal(exact, quantized)
    assert ((quantized - exact).abs() / exact.abs()).max() < 0.02
    computed, master = ({n: torch.tensor(v) for n, v in d.items()} for d in runs[0][2:])
    for name, value in runs[0][2].items():
        assert all(value == run[2][name] for run in runs[1:]), f"{name}: the replicas differ"
    # the parameters computed with are the master quantized once (within half a step of its block), not the master
    assert any(not torch.equal(computed[n], master[n]) for n in computed), "the publish was not quantized"
    half_step = max(v.abs().max() for v in master.values()) / 127 / 2  # a block may span parameters: the largest
    for name, value in computed.items():
        assert (value - master[name]).abs().max() <= half_step * 1.001, name


def test_quantized_weights_on_stage_0_are_refused_naming_why():
    from zerorun import config
    from zerorun.errors import ConfigError

    with pytest.raises(ConfigError, match="zero.quantized_weights: stage 0 gathers no weights"):
        config.loads("script: x\nzero:\n  stage: 0\n  quantized_weights: true\n", "r.yaml")


def _setup_loads(rank: int, world: int) -> tuple[bool, bool]:
    from zerorun import ops
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    Collectives(cpu="gloo")
    exact_loaded = "quantize" in ops._loaded
    Collectives(cpu="gloo", quantized_gradients=True)
    return exact_loaded, "quantize" in ops._loaded


def test_quantized_collectives_load_the_int8_kernel_at_setup_not_in_the_first_backward():
    # rank processes: what a process has loaded is the question
    assert run_ranks(_setup_loads, 2) == [(False, True), (False, True)]
