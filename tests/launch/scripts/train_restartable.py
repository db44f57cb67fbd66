"""A tiny ZeRO run that checkpoints, resumes where it stopped, and can be made to fail.

Every rank prints `rank R step S loss L` for each step and, at the end, its parameters' checksum.
The samples of step S are blocks (seed, S, k) for k over every micro-batch of the global batch:
rank r takes blocks r*A .. r*A+A-1 (A: grad_accum_steps), so 2 ranks x 1 accumulation and 1 rank
x 2 accumulations train on the same samples, and a job that shrinks keeps its data.
`--fail-rank R --fail-at S`: rank R fails before step S (SIGKILL by default, `--code N` to exit
with N); with `--once FILE` only while FILE does not exist (it is created first).
`--hold-at S --hold-world W`: while the job has W ranks, every rank waits before step S until it is
stopped (so a test's kill lands before the job can finish; a shrunken job goes on).
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zerorun
from zerorun.telemetry import probe

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
parser.add_argument("--fail-at", type=int, default=-1)
parser.add_argument("--code", type=int, default=None)
parser.add_argument("--once", default=None)
parser.add_argument("--hold-at", type=int, default=-1)
parser.add_argument("--hold-world", type=int, default=0)
args = parser.parse_args()

recipe = zerorun.recipe()
torch.manual_seed(recipe.train.seed)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine = zerorun.initialize(model)
rank, accum, micro = dist.get_rank(), recipe.train.grad_accum_steps, recipe.train.micro_batch_size
print(f"pid {os.getpid()}", flush=True)
if engine.resumed_from is not None:
    print(f"rank {rank} resumed from {engine.resumed_from} at step {engine.global_step}", flush=True)
for step in range(engine.global_step, recipe.train.steps):
    if step in (args.fail_at, args.hold_at):  # every rank: the fault comes once the background save before it
        engine.wait_checkpoint()  # is committed
    if rank == args.fail_rank and step == args.fail_at and not (args.once and Path(args.once).exists()):
        if args.once:
            Path(args.once).touch()
        print(f"rank {rank} fails before step {step}", flush=True)
        if args.code is None:
            os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(args.code)
    if step == args.hold_at and dist.get_world_size() == args.hold_world:
        print(f"rank {rank} holds before step {step}", flush=True)
        while True:
            time.sleep(0.1)
    losses = []
    for m in range(accum):
        data = torch.Generator().manual_seed(recipe.train.seed * 100_003 + step * 1009 + rank * accum + m)
        x = torch.randn(micro, 8, generator=data)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True).sin())
        engine.backward(loss)
        engine.step()  # saves a checkpoint after every `every_steps`-th update
        losses.append(loss.item())
    print(f"rank {rank} step {step} loss {sum(losses) / accum:.9e}", flush=True)
with engine.gathered():
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"rank {rank} checksum {checksum:.12e}", flush=True)
dist.barrier()
engine.wait_checkpoint()  # os._exit skips the worker's wait for the save still being written
probe.stop()  # os._exit skips the worker's own stop: send the last steps' telemetry first (the test reads it)
os._exit(0)  # as train_tiny.py: skip the interpreter exit that a multi-rank CPU run sometimes aborts in
