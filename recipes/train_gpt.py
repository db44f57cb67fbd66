"""Train a GPT on synthetic tokens with zerorun: a training script written the way users write one.

    zerorun launch recipes/quickstart.yaml              # 2 CPU workers, ZeRO stage 2
    zerorun launch recipes/quickstart.yaml --set zero.stage=1 --set precision=bf16
    zerorun launch recipes/quickstart.yaml --set checkpoint.dir=runs/ckpt --set checkpoint.every_steps=20

With `checkpoint.dir` set, a launch resumes from the latest checkpoint there (checkpoint.resume: auto),
on any number of workers and any ZeRO stage. The batches are a function of (seed, rank, micro-step),
so `engine.global_step` is the whole data position.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import zerorun
from zerorun.bench.gpt import GPT, GPTConfig, synthetic_tokens

# Recipe keys this script applies itself (the engine applies the rest): `zerorun tune` varies only these.
ZERORUN_HONOURS = ["train.activation_checkpointing"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    recipe = zerorun.recipe()
    cfg = GPTConfig(args.layers, args.d_model, args.heads, args.vocab, args.seq_len,
                    checkpoint="non-reentrant" if recipe.train.activation_checkpointing else "none")
    torch.manual_seed(recipe.train.seed)
    # built where it will train: on a GPU, initialising billions of parameters there takes a moment,
    # on the CPU minutes (the engine moves a CPU-built model anyway, and the batches too)
    with torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())  # before stage 3 shards them
    engine = zerorun.initialize(model)  # ZeRO stage, precision and AdamW from the recipe; resumes if it can
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        units = f" ({engine.memory().units} units)" if recipe.zero.stage == 3 else ""
        print(f"GPT {params / 1e6:.2f}M params, {world} ranks, ZeRO stage {recipe.zero.stage}{units}, "
              f"{recipe.precision.dtype}, micro-batch {recipe.train.micro_batch_size} x "
              f"{recipe.train.grad_accum_steps} accumulation", flush=True)
        if engine.resumed_from is not None:
            print(f"resumed from {engine.resumed_from} at step {engine.global_step}", flush=True)

    first = engine.global_step  # 0, or where the checkpoint left off
    micro = first * recipe.train.grad_accum_steps
    for step in range(first, recipe.train.steps):
        start = time.perf_counter()
        for _ in range(recipe.train.grad_accum_steps):
            tokens = synthetic_tokens(cfg, recipe.train.micro_batch_size, recipe.train.seed, rank, micro)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            micro += 1
        elapsed = time.perf_counter() - start
        if rank == 0 and (step % args.log_every == 0 or step == recipe.train.steps - 1):
            tokens_per_s = world * recipe.train.grad_accum_steps * recipe.train.micro_batch_size * cfg.seq_len / elapsed
            print(f"step {step:4d}  loss {loss.item():.4f}  grad-norm {engine.grad_norm:.3f}  "
                  f"{elapsed * 1e3:.0f} ms  {tokens_per_s:,.0f} tokens/s", flush=True)
    every = recipe.checkpoint.every_steps
    if recipe.checkpoint.dir and engine.global_step > first and (not every or engine.global_step % every):
        engine.save_checkpoint()  # the last steps, unless step() has just saved them
    if rank == 0:
        mem = engine.memory()
        print(f"done: {engine.global_step} steps, model states {mem.model_states() / 2**20:.1f} MiB on rank 0 "
              f"({', '.join(f'{k} {v / 2**20:.1f}' for k, v in ((k, mem.total(k)) for k in ('params', 'grads', 'master', 'optimizer')) if v)})",
              flush=True)


if __name__ == "__main__":
    main()
