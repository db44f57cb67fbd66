"""A tiny ZeRO run that checkpoints every `checkpoint.every_steps` and resumes where it stopped.

`zerorun.initialize` resumes from `checkpoint.dir` when it holds a checkpoint (checkpoint.resume:
auto); the batches are a function of (seed, rank, step), so continuing from `engine.global_step` is
the whole data position. Every rank prints its final loss and a checksum of the parameters.
"""

import os

import torch
import torch.distributed as dist

import zerorun
from zerorun.telemetry import probe

recipe = zerorun.recipe()
torch.manual_seed(recipe.train.seed)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine = zerorun.initialize(model)
rank = dist.get_rank()
if engine.resumed_from is not None:
    print(f"rank {rank} resumed from {engine.resumed_from} at step {engine.global_step}", flush=True)
for step in range(engine.global_step, recipe.train.steps):
    data = torch.Generator().manual_seed(recipe.train.seed * 100_003 + rank * 1009 + step)
    x = torch.randn(4, 8, generator=data)
    loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True).sin())
    engine.backward(loss)
    engine.step()  # saves a checkpoint after every `every_steps`-th update
with engine.gathered():
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"rank {rank} final loss {loss.item():.9e} checksum {checksum:.12e}", flush=True)
dist.barrier()
engine.wait_checkpoint()  # os._exit skips the worker's wait for the save still being written
probe.stop()  # os._exit skips the worker's own stop: send the last steps' telemetry first (tests read it)
os._exit(0)  # as train_tiny.py: skip the interpreter exit that a multi-rank CPU run sometimes aborts in
