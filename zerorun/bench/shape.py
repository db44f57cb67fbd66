"""The shape of `bench.gpt.GPT`, and the standard benchmark configuration: defined once, torch-free.

The standard benchmark configuration, so figures compare across issues and with other systems:
12 layers, d_model 768, 12 heads, vocab 8192, sequence 128, untied output head (97.7M parameters).
`zerorun bench step|ckpt` take their model defaults from `BENCHMARK`, and `bench.scale_plan`'s
family starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    layers: int = 12
    d_model: int = 768
    heads: int = 12
    vocab: int = 8192
    seq_len: int = 128
    tie_weights: bool = False
    checkpoint: str = "none"  # activation checkpointing per block: none | reentrant | non-reentrant


BENCHMARK = GPTConfig()
