"""The model and data of ds_train.py, shared with the plain-torch reference in tests/compat.

Parameters of odd sizes (uneven shards on 2 ranks) and token batches that are a pure function of
(seed, rank, micro-step), so every run and the reference see the same data.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, SEQ = 37, 13, 29, 9


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        logits = self.head(x).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def batch(seed: int, rank: int, micro_step: int, size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + micro_step)
    return torch.randint(0, VOCAB, (size, SEQ), generator=gen)
