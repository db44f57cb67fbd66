"""qgZ: block int8 keeps each element within half a step of its block's scale; a quantized reduce-scatter
sums close to the exact one on every rank, and training stays within 2% of exact losses."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from zerorun.runtime.quantize import BLOCK, Quantized, dequantize_add, quantize


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
    from zerorun.runtime.collectives import Collectives
    from zerorun.runtime.dist import init_distributed

    init_distributed()
    full = torch.randn(world * 5000, generator=torch.Generator().manual_seed(rank))
    exact, quantized = torch.empty(5000), torch.empty(5000)
    Collectives(cpu="gloo").reduce_scatter(full.clone(), exact).wait()
    Collectives(cpu="gloo", quantized_gradients=True).reduce_scatter(full.clone(), quantized).wait()
    bound = sum(full.abs().max().item() / 127 / 2 for _ in range(world - 1))  # half a step per peer's piece
    return exact.tolist(), quantized.tolist(), bound


@pytest.mark.parametrize("world", [2, 3])
def test_a_quantized_reduce_scatter_is_within_half_a_step_per_peer_of_the_exact_one(world):
    for exact, quantized, bound in run_ranks(_reduce_scatter, world):
        error = (torch.tensor(exact) - torch.tensor(quantized)).abs().max().item()
        assert 0 < error <= 2 * bound  # the peers' bounds, each from its own data (< 2x ours here)


def _losses(rank: int, world: int) -> tuple[list[float], list[float]]:
    from tests.runtime.reference import engine_run
    from zerorun.runtime.dist import init_distributed

    init_distributed()
    exact, _ = engine_run(rank, 20, 2, ["zero.stage=2", "zero.cpu_collectives=gloo"], None)
    quantized, _ = engine_run(rank, 20, 2, ["zero.stage=2", "zero.cpu_collectives=gloo",
                                            "zero.quantized_gradients=true"], None)
    return exact.losses, quantized.losses


def test_training_with_quantized_gradients_stays_within_two_percent_of_exact_losses():
    exact, quantized = (torch.tensor(x) for x in run_ranks(_losses, 3)[0])
    assert not torch.equal(exact, quantized)  # the quantized path really ran
    assert ((quantized - exact).abs() / exact.abs()).max() < 0.02
