"""A GPT in one screen (nanoGPT's shape): the standard benchmark model and the quick start's model.

Its shape, and the standard benchmark configuration (`BENCHMARK`), live in `bench.shape`, which
imports no torch: the bench commands read their defaults from it without loading the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zerorun.bench.shape import BENCHMARK, GPTConfig

__all__ = ["BENCHMARK", "GPT", "Block", "GPTConfig", "synthetic_tokens"]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = BENCHMARK) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of `tokens` (batch, seq_len + 1)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1], device=tokens.device))
        for block in self.blocks:
            if self.cfg.checkpoint == "none" or not torch.is_grad_enabled():
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.cfg.checkpoint == "reentrant")
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_tokens(cfg: GPTConfig, batch: int, seed: int, rank: int, step: int) -> torch.Tensor:
    """A learnable stream: each token follows a fixed random successor 90% of the time."""
    table = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step + 1)
    tokens = torch.empty(batch, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab, (batch,), generator=gen)
    noise = torch.rand(batch, cfg.seq_len, generator=gen) < 0.1
    random = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
    for t in range(cfg.seq_len):
        tokens[:, t + 1] = torch.where(noise[:, t], random[:, t], table[tokens[:, t]])
    return tokens
