"""Block-quantized int8 for gradients on the wire (`zero.quantized_gradients`, ZeRO++'s qgZ).

A tensor is cut into blocks of BLOCK elements; each block is sent as int8 with one fp32 scale (its
largest magnitude / 127), a quarter of fp32's bytes plus 0.2%. Rounding to the nearest step keeps
each element within half a step (scale / 2) of its value, and a block's error scales with its own
range, not the tensor's, so a small gradient next to a large one keeps its precision. The receiver
dequantizes to fp32 and accumulates in fp32: one quantization per hop, never a sum in int8.

The codec runs for every piece that crosses the network, twice a step with qwZ and qgZ on, so on
the CPU it runs in zerorun's kernel (`kernels/quantize.cpp`: one sweep of memory each way) where
that is built, else in torch (several sweeps); on CUDA in torch's operations on the device. All give
the same bits (the same fp32 divisions, round-half-to-even, clamps), so ranks with and without the
kernel, on CPU or GPU, agree; `tests/test_quantize_kernel.py` holds them to it.

Pieces bound for every rank are quantized side by side into one `QuantizedRows` (values [rows,
blocks x BLOCK] int8, scales [rows, blocks] fp32): the contiguous layout an all-to-all or an
all-gather into a tensor moves in one call (NCCL), and that point-to-point sends row by row (gloo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerorun import ops

BLOCK = 2048  # elements per scale: 0.2% overhead in scales


@dataclass
class Quantized:
    """`values` int8, (blocks, BLOCK); `scales` fp32, (blocks,); the first `numel` elements are the tensor's."""

    values: torch.Tensor
    scales: torch.Tensor
    numel: int

    @classmethod
    def empty(cls, numel: int, device: torch.device | None = None) -> Quantized:
        """Buffers to receive a quantized tensor of `numel` elements into."""
        blocks = -(-numel // BLOCK)
        return cls(torch.empty((blocks, BLOCK), dtype=torch.int8, device=device),
                   torch.empty(blocks, dtype=torch.float32, device=device), numel)

    def payload(self) -> torch.Tensor:
        """The int8 values that travel: the padding of the last block stays home."""
        return self.values.view(-1)[: self.numel]

    def wire(self) -> list[torch.Tensor]:
        """What crosses the network, in order: the int8 values (without the last block's padding), the scales."""
        return [self.payload(), self.scales]

    def nbytes(self) -> int:
        return self.wire_bytes(self.numel)

    @staticmethod
    def wire_bytes(numel: int) -> int:
        """Bytes a tensor of `numel` elements takes on the wire: its int8 values and one fp32 scale per block."""
        return numel + 4 * -(-numel // BLOCK)


@dataclass
class QuantizedRows:
    """`rows` tensors of `numel` elements each, quantized side by side (see the module docstring)."""

    values: torch.Tensor  # int8, (rows, blocks * BLOCK)
    scales: torch.Tensor  # fp32, (rows, blocks)
    numel: int

    @classmethod
    def empty(cls, rows: int, numel: int, device: torch.device | None = None) -> QuantizedRows:
        blocks = -(-numel // BLOCK)
        return cls(torch.empty((rows, blocks * BLOCK), dtype=torch.int8, device=device),
                   torch.empty((rows, blocks), dtype=torch.float32, device=device), numel)

    def row(self, r: int) -> Quantized:
        return Quantized(self.values[r].view(-1, BLOCK), self.scales[r], self.numel)


def quantize(x: torch.Tensor, out: Quantized | None = None) -> Quantized:
    """`x` (any float dtype, contiguous) as block-scaled int8, into `out` (made here when None)."""
    out = out or Quantized.empty(x.numel(), x.device)
    if not ops.quantize_blocks(x.reshape(-1), out.values, out.scales, BLOCK):
        torch_quantize(x, out)
    return out


def torch_quantize(x: torch.Tensor, out: Quantized) -> None:
    """The kernel's arithmetic in torch, with as few passes as torch allows: the block maxima without an
    `abs()` copy, and the division written straight into the one fp32 scratch. An inf or a NaN in a block
    makes every value it dequantizes to a NaN, as in the kernel (not the same int8 and scale bits there)."""
    numel, flat = x.numel(), x.reshape(-1)
    blocks, whole = -(-numel // BLOCK), numel // BLOCK
    grid = torch.empty((blocks, BLOCK), dtype=torch.float32, device=x.device)
    scales = out.scales
    body = flat[:whole * BLOCK].view(whole, BLOCK)
    if body.dtype != torch.float32:  # bf16/fp16: widened once, then worked on in place
        body = grid[:whole].copy_(body)
    torch.linalg.vector_norm(body, float("inf"), dim=1, out=scales[:whole])
    if whole < blocks:  # the last block, padded with zeros (a received block's padding is never read)
        tail = grid[whole:].view(-1)
        tail[numel - whole * BLOCK:].zero_()
        tail[:numel - whole * BLOCK].copy_(flat[whole * BLOCK:])
        scales[whole:] = tail.abs().amax()
    scales.div_(scales.new_full((), 127.0))  # a device tensor: CUDA divides by a host scalar as a product by its
                                             # reciprocal, a last-bit difference in some scales (seen on an H200)
    scales.masked_fill_(scales == 0, 1.0)  # an all-zero block: any scale gives zeros (no host sync on CUDA)
    torch.div(body, scales[:whole, None], out=grid[:whole])
    grid[whole:].div_(scales[whole:, None])
    out.values.copy_(grid.round_().clamp_(-127, 127))  # whole numbers: exact in int8


def dequantize_add(q: Quantized, into: torch.Tensor) -> torch.Tensor:
    """`into` (fp32) += the dequantized values of `q`; returns `into` (the same bits as adding
    `dequantize_into`'s result: a product, then a sum, never a fused multiply-add)."""
    if ops.dequantize_blocks(q.values, q.scales, into, BLOCK, accumulate=True):
        return into
    return torch_dequantize_add(q, into)


def torch_dequantize_add(q: Quantized, into: torch.Tensor) -> torch.Tensor:
    return into.add_(torch_dequantize_into(q, torch.empty_like(into)))


def dequantize_into(q: Quantized, out: torch.Tensor) -> torch.Tensor:
    """`out` (any float dtype) = the dequantized values of `q`; returns `out`."""
    if ops.dequantize_blocks(q.values, q.scales, out, BLOCK):
        return out
    return torch_dequantize_into(q, out)


def torch_dequantize_into(q: Quantized, out: torch.Tensor) -> torch.Tensor:
    """Whole blocks go straight into `out` when it is fp32 (one pass); the rest through a block of scratch."""
    whole = q.numel // BLOCK
    flat = out.view(-1)
    if out.dtype == torch.float32:
        torch.mul(q.values[:whole], q.scales[:whole, None], out=flat[:whole * BLOCK].view(whole, BLOCK))
    else:
        flat[:whole * BLOCK].copy_((q.values[:whole] * q.scales[:whole, None]).view(-1))
    if whole * BLOCK < q.numel:
        flat[whole * BLOCK:].copy_((q.values[whole:] * q.scales[whole:, None]).view(-1)[:q.numel - whole * BLOCK])
    return out
