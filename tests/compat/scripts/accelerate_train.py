"""A plain accelerate script: Accelerator + prepare/accumulate/backward/save_state/load_state.

    torchrun --nproc-per-node 2 accelerate_train.py --record R                      # DDP (accelerate, CPU)
    zerorun launch --num_gpus 2 accelerate_train.py --zero_stage 2 --record R       # DeepSpeedPlugin(zero_stage=2)

With `--zero_stage` the Accelerator gets `DeepSpeedPlugin(zero_stage=..., gradient_clipping=...)`;
without, it runs accelerate's CPU DDP. The model is a small MLP, the data synthetic. It trains
`--steps` updates with accumulation 2, saves its state after `--save_at` updates, and each rank
writes the loss of every micro-step to `<record>.rank<r>.json`; `--resume` loads the saved state and
trains the remaining updates.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

ACCUM, MICRO, CLIP = 2, 2, 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero_stage", type=int, default=None)
    parser.add_argument("--record", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_at", type=int, default=2)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)  # what DeepSpeed-style launchers pass
    args = parser.parse_args()

    if args.zero_stage is None:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    else:
        plugin = DeepSpeedPlugin(zero_stage=args.zero_stage, gradient_accumulation_steps=ACCUM, gradient_clipping=CLIP)
        accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 / (1 + update))
    inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    start = 0
    if args.resume:
        accelerator.load_state(args.ckpt)
        start = args.save_at
    losses, updates = [], start
    batches = iter(loader)
    for _ in range(start * ACCUM):  # the data the saved run already used
        next(batches)
    while updates < args.steps:
        x, y = next(batches)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)  # DeepSpeed: the engine clips (plugin)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if accelerator.sync_gradients:
            updates += 1
            if updates == args.save_at and args.ckpt and not args.resume:
                accelerator.save_state(args.ckpt)
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{args.record}.rank{rank}.json", "w") as file:
        json.dump({"losses": losses, "lr": scheduler.get_last_lr()}, file)
    # as accelerate's examples end: without it a gloo rank can abort at exit ("terminate called without an active
    # exception": its process group's threads outlive the interpreter), seen once under plain torchrun
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
