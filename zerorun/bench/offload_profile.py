"""Where one ZeRO-Offload step goes on one GPU: forward, backward and optimizer, each timed to its end.

    python -m zerorun.bench.offload_profile --layers 39 --d-model 4096 --heads 32            # stage 2, optimizer on the CPU
    python -m zerorun.bench.offload_profile --layers 42 --d-model 4096 --heads 32 --stage 3 --set zero.offload_param=cpu

A single process (world size 1, no launcher): the GPT of `recipes/offload_one_gpu.yaml` built on the
GPU, bf16, activation checkpointing, the fp32 master weights and Adam moments in pinned host memory.
Each phase ends in a device synchronisation, so the three times add up to the step; the offload
line gives the bytes and the event-timed seconds of the copies between GPU and host.
"""

from __future__ import annotations

import argparse
import time

import torch

import zerorun
from zerorun import config
from zerorun.bench.gpt import GPT, GPTConfig, synthetic_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="the first is a warm-up, not averaged")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more recipe overrides")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(args.layers, args.d_model, args.heads, 8192, args.seq_len, checkpoint="non-reentrant")
    torch.manual_seed(0)
    with device:
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    recipe = config.loads("script: offload_profile.py", "<offload_profile>", [
        f"zero.stage={args.stage}", "zero.offload_optimizer=cpu", "precision.dtype=bf16", "zero.bucket_mb=200",
        "zero.allgather_bucket_mb=200", "optimizer.lr=1e-4", "telemetry.enabled=false", *args.set])
    from zerorun.runtime import host_allocator

    host_allocator.install()  # as the worker does: zero.host_memory applies
    engine = zerorun.initialize(model, None, recipe)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    phases = []
    for step in range(args.steps):
        tokens = synthetic_tokens(cfg, args.micro_batch, 0, 0, step)
        sync()
        marks = [time.perf_counter()]
        loss = engine(tokens)
        sync()
        marks.append(time.perf_counter())
        engine.backward(loss)
        sync()
        marks.append(time.perf_counter())
        engine.step()
        sync()
        marks.append(time.perf_counter())
        phases.append([b - a for a, b in zip(marks, marks[1:])])
        print(f"step {step}: forward {phases[-1][0]:.3f} s, backward {phases[-1][1]:.3f} s, optimizer "
              f"{phases[-1][2]:.3f} s, loss {loss.item():.4f}", flush=True)
    timed = phases[1:] or phases
    forward, backward, optimizer = (sum(p[k] for p in timed) / len(timed) for k in range(3))
    flops = 6 * params * args.micro_batch * args.seq_len
    print(f"{params / 1e9:.2f}B parameters, ZeRO stage {args.stage}: forward {forward:.3f} s + backward {backward:.3f} s "
          f"({flops / (forward + backward) / 1e12:.0f} model TFLOP/s) + optimizer {optimizer:.3f} s "
          f"({params / optimizer / 1e9:.2f} G params/s) = {forward + backward + optimizer:.3f} s a step")
    stats = engine.update.stats()
    print("offload, all steps: " + ", ".join(
        f"{d.upper()} {s['bytes'] / 2**30:.1f} GiB in {s['seconds']:.2f} s" for d, s in stats.items()
        if d != "wait" and s["bytes"]) + f"; the step waited {stats.get('wait', {}).get('seconds', 0):.2f} s on copies")


if __name__ == "__main__":
    main()
