"""A GPT trainer written for torchrun, as nanoGPT's train.py is: it joins the process group itself, wraps its
model in DDP (or, ported, in zerorun.initialize), accumulates with no_sync, evaluates and saves on the master
process only. Rank 0 prints `iter I loss L` per iteration and `eval I val V` per evaluation.

--wrap ddp|zerorun          the script as written for DDP, or ported (zerorun.initialize; the recipe accumulates)
--backend gloo|nccl|none    init_process_group(backend=...); none: it never calls init_process_group
--eval master|all|gathered  every --eval-every iterations: estimate_loss() under `if master_process:` (the habit),
                            on every rank, or on the master inside engine.gathered()
--save master|all|none      each evaluation: `torch.save(raw_model.state_dict())` on the master only (the habit), the
                            state dict taken on every rank and saved by the master, or nothing
--stop-early-rank R         rank R's data ends after --stop-at iterations (a loader that ran out on one rank)
--recipe FILE               zerorun's recipe when run by plain torchrun (under zerorun launch it is injected)
"""

import argparse
import os
import tempfile
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--wrap", choices=["ddp", "zerorun"], default="ddp")
parser.add_argument("--backend", default="gloo")
parser.add_argument("--eval", choices=["master", "all", "gathered", "none"], default="none")
parser.add_argument("--eval-every", type=int, default=3)
parser.add_argument("--save", choices=["master", "all", "none"], default="none")
parser.add_argument("--iters", type=int, default=6)
parser.add_argument("--accum", type=int, default=2)
parser.add_argument("--stop-early-rank", type=int, default=-1)
parser.add_argument("--stop-at", type=int, default=2)
parser.add_argument("--recipe", default=None)
args = parser.parse_args()

VOCAB, BLOCK, EMBD, HEADS, LAYERS, BATCH = 65, 16, 32, 4, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.attn = nn.MultiheadAttention(EMBD, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(EMBD, 4 * EMBD), nn.GELU(), nn.Linear(4 * EMBD, EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    if args.backend != "none":
        init_process_group(backend=args.backend)
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
else:
    ddp_rank, ddp_world_size, master_process = 0, 1, True
torch.manual_seed(1337)
data = torch.randint(0, VOCAB, (4096,), generator=torch.Generator().manual_seed(0))


def get_batch(split: str, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(((ddp_rank * 1000 + it) * 10 + micro) * (1 if split == "train" else 7))
    ix = torch.randint(len(data) - BLOCK - 1, (BATCH,), generator=gen)
    return torch.stack([data[i:i + BLOCK] for i in ix]), torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
if args.wrap == "ddp":
    model = DDP(model) if ddp else model
    raw_model = model.module if ddp else model
    engine = None
    if ddp:  # freed after the script's own destroy_process_group(): says whether zerorun still holds that group
        # (exec'd with globals of its own: a function of this script would hold the script's globals, and the model)
        weakref.finalize(model, exec, "import torch.distributed as d; print('ddp freed, its destroyed group held:', "
                                      "hasattr(d.destroy_process_group, '__wrapped__'), flush=True)", {})
else:
    import zerorun
    from zerorun import config

    engine = zerorun.initialize(model, optimizer, config.load(args.recipe) if args.recipe else None)
    raw_model = model


@torch.no_grad()
def estimate_loss(it: int) -> float:
    model.eval()
    losses = [float((engine or model)(*get_batch("val", it, k))) for k in range(2)]
    model.train()
    return sum(losses) / len(losses)


def evaluate(it: int) -> None:
    if args.eval == "master" and master_process:
        print(f"eval {it} val {estimate_loss(it):.6f}", flush=True)
    elif args.eval == "all":
        val = estimate_loss(it)
        if master_process:
            print(f"eval {it} val {val:.6f}", flush=True)
    elif args.eval == "gathered":
        with engine.gathered():
            if master_process:
                print(f"eval {it} val {estimate_loss(it):.6f}", flush=True)
    if args.save == "master" and master_process:
        torch.save({"model": raw_model.state_dict(), "iter_num": it}, os.path.join(tempfile.gettempdir(), "ckpt.pt"))
    elif args.save == "all":
        state = raw_model.state_dict()
        if master_process:
            print(f"saved {it} {sum(v.numel() for v in state.values())} values", flush=True)


iters = args.stop_at if ddp_rank == args.stop_early_rank else args.iters
for it in range(iters):
    if it and it % args.eval_every == 0 and (args.eval, args.save) != ("none", "none"):
        evaluate(it)
    if engine is not None:  # ported: the recipe accumulates (train.grad_accum_steps)
        for micro in range(engine.grad_accum_steps):
            loss = engine(*get_batch("train", it, micro))
            engine.backward(loss)
            engine.step()
    else:
        for micro in range(args.accum):
            if ddp:
                model.require_backward_grad_sync = micro == args.accum - 1  # nanoGPT's no_sync
            loss = model(*get_batch("train", it, micro)) / args.accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss * args.accum
    if master_process:
        print(f"iter {it} loss {loss.item():.6f}", flush=True)
if ddp and args.backend != "none":
    # As DDP: every rank past its last all-reduce before any tears its group down (without it a gloo rank aborted
    # at exit under plain torchrun, "terminate called without an active exception"). Ported, the script leaves the
    # meeting to zerorun's destroy_process_group, which a rank whose data ran out early must reach unmet.
    if args.wrap == "ddp":
        barrier()
    destroy_process_group()
