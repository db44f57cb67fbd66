"""A training loop as a DDP or FSDP user writes it: own model, own optimizer and LR schedule, own habits.

A tiny language model with a tied embedding, two param groups (no decay for biases and norms), an
AdamW and a LambdaLR warm-up + cosine built by the script. Rank 0 prints, for every update,
`update U loss L lr LR` (the lr that update used) and, at the end, `checksum C` of the parameters.

--accum zerorun   engine.backward(loss) + engine.step() per micro-batch (the recipe accumulates)
--accum ddp       W x engine.backward(loss / W), then engine.step() (W: --window)
--accum no_sync   the same, all but the last backward inside engine.no_sync()
--schedule after|before|none   build the LambdaLR after zerorun.initialize, before it, or not at all
--clip X          torch.nn.utils.clip_grad_norm_(model.parameters(), X) before every step (prints its norm)
--no-optimizer    zerorun.initialize(model): the recipe's optimizer
--fail-at U --once FILE   rank 1 is SIGKILLed before update U, while FILE does not exist (created first),
                          once every rank has waited for the checkpoint in flight to commit
"""

import argparse
import math
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grad_norm_  # bound at import, before zerorun.initialize, as scripts do

import zerorun
from zerorun.telemetry import probe

parser = argparse.ArgumentParser()
parser.add_argument("--accum", choices=["zerorun", "ddp", "no_sync"], default="zerorun")
parser.add_argument("--window", type=int, default=2)
parser.add_argument("--schedule", choices=["after", "before", "none"], default="after")
parser.add_argument("--clip", type=float, default=None)
parser.add_argument("--no-optimizer", action="store_true")
parser.add_argument("--fail-at", type=int, default=-1)
parser.add_argument("--once", default=None)
args = parser.parse_args()

VOCAB, DIM, SEQ = 48, 32, 12


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.norm(h + self.body(h)))


def warmup_cosine(total: int, warmup: int = 4):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return factor


recipe = zerorun.recipe()
torch.manual_seed(recipe.train.seed)
model = TinyLM()
decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
optimizer = None if args.no_optimizer else torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95))
steps = recipe.train.steps
schedule = None
if args.schedule == "before":
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
engine = zerorun.initialize(model, optimizer)
if args.schedule == "after":
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer or engine.optimizer, warmup_cosine(steps))
rank, world = dist.get_rank(), dist.get_world_size()
micro = recipe.train.micro_batch_size
per_update = recipe.train.grad_accum_steps if args.accum == "zerorun" else args.window
if rank == 0 and engine.resumed_from is not None:
    print(f"resumed from {engine.resumed_from} at update {engine.global_step}", flush=True)


def batch(update: int, k: int) -> torch.Tensor:
    """Micro-batch k of update `update` on this rank: the same samples however the loop is spelled."""
    g = torch.Generator().manual_seed(recipe.train.seed * 7919 + update * 131 + (rank * per_update + k))
    return torch.randint(0, VOCAB, (micro, SEQ + 1), generator=g)


def lm_loss(tokens: torch.Tensor) -> torch.Tensor:
    logits = engine(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def clip(max_norm: float) -> None:
    norm = float(clip_grad_norm_(model.parameters(), max_norm))
    if rank == 0:
        print(f"clip norm {norm:.6e}", flush=True)


for update in range(engine.global_step, steps):
    if update == args.fail_at:  # every rank: the fault comes once the background save before it is committed
        engine.wait_checkpoint()  # (else, under load, the kill can land first and the restart starts from scratch)
    if rank == 1 and update == args.fail_at and not Path(args.once).exists():
        Path(args.once).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    losses = []
    for k in range(per_update):
        tokens = batch(update, k)
        if args.accum == "zerorun":
            loss = lm_loss(tokens)
            engine.backward(loss)
            if args.clip is not None and engine.is_boundary:
                clip(args.clip)
            engine.step()
        else:
            last = k == per_update - 1
            with engine.no_sync() if args.accum == "no_sync" and not last else torch.enable_grad():
                loss = lm_loss(tokens)
                engine.backward(loss / per_update)
        losses.append(loss.item())
        if k == 0:  # the lr this update uses (after the first forward: a schedule built after a resume is restored there)
            lr = engine.optimizer.param_groups[0]["lr"]
    if args.accum != "zerorun":
        if args.clip is not None:
            clip(args.clip)
        engine.step()
    if schedule is not None:
        schedule.step()
    if rank == 0:
        print(f"update {update} loss {sum(losses) / len(losses):.9e} lr {lr:.9e} grad-norm {engine.grad_norm:.6e}",
              flush=True)
with engine.gathered():
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
if rank == 0:
    print(f"checksum {checksum:.12e}", flush=True)
dist.barrier()
probe.stop()
