"""A training script in DeepSpeed's documented style; the tests run it unchanged under zerorun and DeepSpeed.

    deepspeed      --num_gpus 2 ds_train.py --deepspeed --deepspeed_config ds.json --out run.json
    zerorun launch --num_gpus 2 ds_train.py --deepspeed --deepspeed_config ds.json --out run.json

Each rank writes its micro-step losses and the lr of every optimizer step to `<out>.rank<r>.json`.
With --ckpt and --save_at it saves a checkpoint (with client_state) after that step; with --resume
it loads the latest one and continues from the step its client_state names.
"""

import argparse
import json
import os
import sys

import deepspeed
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
from tests.runtime.reference import batch, make_model  # noqa: E402 - the tests' one tiny model (plain=True here)


def parse_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-style training")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ckpt", default=None, help="checkpoint directory")
    parser.add_argument("--save_at", type=int, default=0, help="save after this many steps")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", required=True)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    model = make_model(args.seed, plain=True)
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                              model_parameters=model.parameters())
    rank = dist.get_rank()
    accum = engine.gradient_accumulation_steps()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    start, client = 0, None
    if args.resume:
        _, client = engine.load_checkpoint(args.ckpt)
        start = client["step"]
    record = {"losses": [], "lrs": [], "start": start, "client_state": client, "local_rank": args.local_rank,
              "global_steps": []}
    for step in range(start, args.steps):
        record["lrs"].append(engine.get_lr()[0])
        for micro in range(accum):
            loss = engine(batch(args.seed, rank, step * accum + micro, micro_batch))
            engine.backward(loss)
            assert engine.is_gradient_accumulation_boundary() == (micro == accum - 1)
            engine.step()
            record["losses"].append(loss.item())
        record["global_steps"].append(engine.global_steps)
        if args.ckpt and step + 1 == args.save_at and not args.resume:
            engine.save_checkpoint(args.ckpt, client_state={"step": step + 1, "note": "from ds_train"})
    with open(f"{args.out}.rank{rank}.json", "w") as file:
        json.dump(record, file)
    dist.barrier()


if __name__ == "__main__":
    main()
