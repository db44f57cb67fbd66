"""A tiny token model trained through zerorun's engine, for the telemetry tests.

Each rank prints `pid N`, trains `train.steps` steps on random token ids (batch 4 x 9 tokens),
and at the end prints `memory <json of engine.memory().as_dict()>`. `--sleep-rank R --sleep-at S`
makes rank R sleep in `sleep_here` before step S (a stalled rank); `--raise-rank R --raise-at S` makes it
raise a ValueError there instead (its peers then fail waiting for it); `--step-delay` slows every step.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import zerorun


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(tokens[:, :-1]).mean(dim=1))
        return nn.functional.cross_entropy(logits, tokens[:, -1])


def sleep_here(seconds: float) -> None:
    time.sleep(seconds)  # the frame the stall report must show


parser = argparse.ArgumentParser()
parser.add_argument("--sleep-rank", type=int, default=None)
parser.add_argument("--sleep-at", type=int, default=0)
parser.add_argument("--sleep-s", type=float, default=60.0)
parser.add_argument("--raise-rank", type=int, default=None)
parser.add_argument("--raise-at", type=int, default=0)
parser.add_argument("--step-delay", type=float, default=0.0)
args = parser.parse_args()

recipe = zerorun.recipe()
torch.manual_seed(0)
engine = zerorun.initialize(Tiny())
rank = dist.get_rank()
print(f"pid {os.getpid()}", flush=True)
data = torch.Generator().manual_seed(rank)
for step in range(recipe.train.steps):
    if rank == args.sleep_rank and step == args.sleep_at:
        print("sleeping", flush=True)
        sleep_here(args.sleep_s)
    if rank == args.raise_rank and step == args.raise_at:
        raise ValueError(f"bad batch on rank {rank}")
    loss = engine(torch.randint(0, 64, (4, 9), generator=data))
    engine.backward(loss)
    engine.step()
    time.sleep(args.step_delay)
print("memory " + json.dumps(engine.memory().as_dict()), flush=True)
