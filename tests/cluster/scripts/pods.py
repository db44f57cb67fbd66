"""What the emulated pods train: a tiny model under zerorun beside a DDP + torch AdamW reference on the same data.

Every rank prints `rank R host H step S loss L` per step and, at the end, `rank R parity D`: the largest
difference between zerorun's parameters and the reference's. A resumed run (checkpoint.dir) prints
`rank R resumed from TAG at step S` and has no reference (it would start from scratch).
--fail-rank R --fail-at S: rank R prints `rank R fails on purpose before step S` and raises RuntimeError there.
--step-s X: each step takes at least X seconds (time for a test to act mid-run).
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import zerorun
from zerorun.telemetry import probe

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--fail-at", type=int, default=-1)
parser.add_argument("--step-s", type=float, default=0.0)
args = parser.parse_args()

recipe = zerorun.recipe()
rank = dist.get_rank()


def build() -> torch.nn.Module:
    torch.manual_seed(recipe.train.seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


model = build()
engine = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
reference = optimizer = None
if engine.resumed_from is not None:
    print(f"rank {rank} resumed from {engine.resumed_from} at step {engine.global_step}", flush=True)
else:
    reference = DistributedDataParallel(build())
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
for step in range(engine.global_step, recipe.train.steps):
    started = time.monotonic()
    if rank == args.fail_rank and step == args.fail_at:
        print(f"rank {rank} fails on purpose before step {step}", flush=True)
        raise RuntimeError(f"rank {rank} fails on purpose")
    data = torch.Generator().manual_seed(1009 * step + rank)
    x = torch.randn(recipe.train.micro_batch_size, 8, generator=data)
    target = x.sum(dim=1, keepdim=True).sin()
    loss = torch.nn.functional.mse_loss(engine(x), target)
    engine.backward(loss)
    engine.step()
    if reference is not None and optimizer is not None:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), target).backward()
        optimizer.step()
    print(f"rank {rank} host {socket.gethostname()} step {step} loss {loss.item():.9e}", flush=True)
    time.sleep(max(0.0, args.step_s - (time.monotonic() - started)))
if reference is not None:
    with engine.gathered():
        parity = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), reference.module.parameters()))
    print(f"rank {rank} parity {parity:.3e}", flush=True)
engine.wait_checkpoint()
dist.barrier()
probe.stop()  # os._exit skips the worker's own stop
os._exit(0)  # as the launch tests' scripts: skip the interpreter exit a multi-rank CPU run sometimes aborts in
