"""Block-quantized int8 for gradients on the wire (`zero.quantized_gradients`, ZeRO++'s qgZ).

A tensor is cut into blocks of BLOCK elements; each block is sent as int8 with one fp32 scale (its
largest magnitude / 127), a quarter of fp32's bytes plus 0.2%. Rounding to the nearest step keeps
each element within half a step (scale / 2) of its value, and a block's error scales with its own
range, not the tensor's, so a small gradient next to a large one keeps its precision. The receiver
dequantizes to fp32 and accumulates in fp32: one quantization per hop, never a sum in int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 2048  # elements per scale: 0.2% overhead in scales


@dataclass
class Quantized:
    """`values` int8, (blocks, BLOCK); `scales` fp32, (blocks,); the first `numel` elements are the tensor's."""

    values: torch.Tensor
    scales: torch.Tensor
    numel: int

    @classmethod
    def empty(cls, numel: int) -> Quantized:
        """Buffers to receive a quantized tensor of `numel` elements into."""
        blocks = -(-numel // BLOCK)
        return cls(torch.empty((blocks, BLOCK), dtype=torch.int8), torch.empty(blocks, dtype=torch.float32), numel)

    def payload(self) -> torch.Tensor:
        """The int8 values that travel: the padding of the last block stays home."""
        return self.values.view(-1)[: self.numel]

    def nbytes(self) -> int:
        return self.numel + 4 * self.scales.numel()


def quantize(x: torch.Tensor) -> Quantized:
    """`x` (any float dtype, contiguous) as block-scaled int8."""
    numel = x.numel()
    blocks = -(-numel // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)  # zeros: a received block's padding is never read
    padded[:numel] = x.reshape(-1)
    grid = padded.view(blocks, BLOCK)
    scales = grid.abs().amax(dim=1).div_(127.0)
    scales[scales == 0] = 1.0  # an all-zero block: any scale gives zeros
    values = grid.div_(scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return Quantized(values, scales, numel)


def dequantize_add(q: Quantized, into: torch.Tensor) -> torch.Tensor:
    """`into` (fp32) += the dequantized values of `q`; returns `into`."""
    flat = (q.values.to(torch.float32) * q.scales[:, None]).view(-1)[:q.numel]  # padding: computed, dropped
    return into.add_(flat.view_as(into))


def dequantize_into(q: Quantized, out: torch.Tensor) -> torch.Tensor:
    """`out` (any float dtype) = the dequantized values of `q`; returns `out`."""
    flat = (q.values.to(torch.float32) * q.scales[:, None]).view(-1)[:q.numel]
    return out.copy_(flat.view_as(out))
