"""Train a byte-level GPT on real text with zerorun: a held-out validation loss, and a sample at the end.

    zerorun launch recipes/text.yaml                                  # the shipped text, 2 CPU workers
    zerorun launch recipes/text.yaml --set 'args=[--text,/path/to/book.txt]'
    zerorun report runs/text                                          # the loss curve, as plots

The shipped text, recipes/data/shakespeare.txt, is the first 400 KB of the "tiny Shakespeare"
collection of Shakespeare's plays (public domain), as published in the char-rnn repository of
Andrej Karpathy (github.com/karpathy/char-rnn, data/tinyshakespeare/input.txt).

Tokens are the text's bytes (a vocabulary of 256, so any file works). The last `--val-fraction` of
the text is held out: the validation loss is measured on it, never trained on, and printed next to
the text's unigram entropy (the loss of a model that knows only how often each byte occurs), so
the number says whether the model learnt more than byte frequencies. Training windows are a
function of (seed, rank, micro-step), so `engine.global_step` is the whole data position and a
resumed run reads the same batches.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zerorun
from zerorun.bench.gpt import GPT, GPTConfig
from zerorun.errors import ZerorunError
from zerorun.runtime.engine import Engine

ZERORUN_HONOURS = ["train.activation_checkpointing"]
DEFAULT_TEXT = Path(__file__).parent / "data" / "shakespeare.txt"


class TextGPT(GPT):
    """The benchmark GPT, whose forward can also return the next byte's logits (for sampling)."""

    def forward(self, tokens: torch.Tensor, last_logits: bool = False) -> torch.Tensor:  # type: ignore[override]
        if not last_logits:
            return super().forward(tokens)
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, -1])).float()


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the byte frequencies, in nats: the loss of the best model that ignores context."""
    p = torch.bincount(data, minlength=256).double() / data.numel()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def windows(data: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - length, (batch,), generator=gen)
    return torch.stack([data[s:s + length] for s in starts.tolist()])


@torch.no_grad()
def validation_loss(engine: Engine, val: torch.Tensor, cfg: GPTConfig, batches: int, batch: int) -> float:
    """Mean loss over the same held-out windows every time; the ranks split them and average."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = max(1, batches // world)  # the same count on every rank: a stage 3 forward is collective
    gen = torch.Generator().manual_seed(1234)
    held_out = [windows(val, batch, cfg.seq_len + 1, gen) for _ in range(per_rank * world)]
    engine.eval()
    total = torch.zeros(1)
    for tokens in held_out[rank * per_rank:(rank + 1) * per_rank]:
        total += engine(tokens).item()
    dist.all_reduce(total)
    engine.train()
    return float(total) / (per_rank * world)


@torch.no_grad()
def sample(engine: Engine, prompt: bytes, length: int, cfg: GPTConfig, seed: int) -> bytes:
    """`length` bytes after `prompt`, drawn at temperature 0.8; rank 0 draws, every rank runs the forward."""
    engine.eval()
    gen = torch.Generator().manual_seed(seed)
    out = list(prompt)
    for _ in range(length):
        context = torch.tensor([out[-cfg.seq_len:]], dtype=torch.long)
        logits = engine(context, last_logits=True)[0].cpu()
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=gen)
        dist.broadcast(nxt, src=0)  # the same byte on every rank, whatever their rounding
        out.append(int(nxt))
    engine.train()
    return bytes(out)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="a text file (read as bytes)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--val-fraction", type=float, default=0.1)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--sample-bytes", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    return parser.parse_args()


def report_validation(engine: Engine, val: torch.Tensor, cfg: GPTConfig, args: argparse.Namespace, step: int,
                      entropy: float) -> float:
    val_loss = validation_loss(engine, val, cfg, args.eval_batches, zerorun.recipe().train.micro_batch_size)
    if dist.get_rank() == 0:
        print(f"step {step:4d}  validation loss {val_loss:.4f} nats/byte ({val_loss / math.log(2):.3f} bits; "
              f"unigram entropy {entropy:.3f})", flush=True)
    return val_loss


def train(engine: Engine, data: torch.Tensor, val: torch.Tensor, cfg: GPTConfig, args: argparse.Namespace,
          entropy: float) -> None:
    """From the engine's step (0, or where a checkpoint left off) to train.steps, evaluating on the way."""
    recipe, rank = zerorun.recipe(), dist.get_rank()
    micro = engine.global_step * recipe.train.grad_accum_steps
    for step in range(engine.global_step, recipe.train.steps):
        start = time.perf_counter()
        for _ in range(recipe.train.grad_accum_steps):
            gen = torch.Generator().manual_seed(recipe.train.seed * 1_000_003 + rank * 10_007 + micro)
            loss = engine(windows(data, recipe.train.micro_batch_size, cfg.seq_len + 1, gen))
            engine.backward(loss)
            engine.step()
            micro += 1
        if rank == 0 and (step % args.log_every == 0 or step == recipe.train.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad-norm {engine.grad_norm:.3f}  "
                  f"{(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)
        if (step + 1) % args.eval_every == 0 and step < recipe.train.steps - 1:
            report_validation(engine, val, cfg, args, step, entropy)


def main() -> None:
    args = arguments()
    recipe = zerorun.recipe()
    data = torch.frombuffer(bytearray(args.text.read_bytes()), dtype=torch.uint8).long()
    split = int(data.numel() * (1 - args.val_fraction))
    train_data, val = data[:split], data[split:]
    cfg = GPTConfig(args.layers, args.d_model, args.heads, 256, args.seq_len,
                    checkpoint="non-reentrant" if recipe.train.activation_checkpointing else "none")
    if val.numel() <= cfg.seq_len + 1 or train_data.numel() <= cfg.seq_len + 1:
        raise ZerorunError(f"{args.text}: {data.numel()} bytes is too short for --seq-len {cfg.seq_len} "
                           f"with --val-fraction {args.val_fraction}")
    torch.manual_seed(recipe.train.seed)
    engine = zerorun.initialize(TextGPT(cfg))
    rank, first = dist.get_rank(), engine.global_step
    entropy = unigram_entropy(train_data)
    if rank == 0:
        print(f"{args.text.name}: {train_data.numel():,} bytes to train on, {val.numel():,} held out; unigram "
              f"entropy {entropy:.3f} nats/byte. GPT {engine.num_parameters() / 1e6:.2f}M params, "
              f"{dist.get_world_size()} ranks, ZeRO stage {recipe.zero.stage}, {recipe.precision.dtype}", flush=True)
    train(engine, train_data, val, cfg, args, entropy)
    val_loss = report_validation(engine, val, cfg, args, recipe.train.steps - 1, entropy)
    every = recipe.checkpoint.every_steps
    if recipe.checkpoint.dir and engine.global_step > first and (not every or engine.global_step % every):
        engine.save_checkpoint()
    text = sample(engine, val[:cfg.seq_len // 2].to(torch.uint8).numpy().tobytes(), args.sample_bytes, cfg,
                  recipe.train.seed)
    if rank == 0:
        print("sample (prompt: the start of the held-out text):", flush=True)
        for line in text.decode("utf-8", errors="replace").splitlines():
            print(f"| {line}", flush=True)
        print(f"done: {engine.global_step} steps, validation loss {val_loss:.4f} against a unigram entropy of "
              f"{entropy:.4f} nats/byte", flush=True)


if __name__ == "__main__":
    main()
