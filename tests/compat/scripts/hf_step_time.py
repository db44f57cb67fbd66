"""Step time of the Hugging Face Trainer script: DDP, zerorun and the real DeepSpeed at ZeRO stages 2 and 3.

    python tests/compat/scripts/hf_step_time.py --out /tmp/hf_step_time [--rounds 2]

Writes a GPT-2 (6 layers, d_model 512, vocab 8192, sequence 128: 23.2M parameters, tied) as a
`save_pretrained` directory, then runs `hf_train.py` on 2 ranks for 12 updates (micro-batch 2, no
accumulation, clipping, the Trainer's AdamW) under each system in turn, `--rounds` times
interleaved, and prints the median time per update after the first 2 (rank 0's clock) with its
ratio to DDP's in the same round. The real DeepSpeed runs are left out where it is not installed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[3]))

from tests.compat import hf_runs  # noqa: E402

ARGS = ["--max_steps", "12", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
        "--max_grad_norm", "1.0", "--samples", "64", "--seq", "128", *hf_runs.HF_OPTIMIZER]


def write_model(tmp: Path) -> int:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=8192, n_positions=128, n_embd=512, n_layer=6, n_head=8, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(tmp / "model")
    return sum(p.numel() for p in model.parameters())


def seconds_per_update(records: list[dict]) -> float:
    ends = records[0]["step_ends"]
    return statistics.median(b - a for a, b in zip(ends[2:], ends[3:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"GPT-2 of {write_model(args.out) / 1e6:.1f}M parameters, 2 ranks x 1 thread", flush=True)
    try:
        from tests.compat.real_deepspeed import deepspeed_python

        python = deepspeed_python()
    except BaseException:  # pytest's Skipped: no real DeepSpeed here
        python = None
    for round_ in range(args.rounds):
        systems = {"DDP": lambda n: hf_runs.ddp(args.out, n, *ARGS)}
        for stage in (2, 3):
            ds = hf_runs.stage_config(args.out, stage)
            systems[f"zerorun stage {stage}"] = lambda n, ds=ds: hf_runs.zerorun(args.out, n, ds, *ARGS)
            if python is not None:
                systems[f"DeepSpeed ZeRO-{stage}"] = lambda n, ds=ds: hf_runs.real_deepspeed(args.out, n, python,
                                                                                           ds, *ARGS)
        times = {name: seconds_per_update(run(f"r{round_}_{name.replace(' ', '_')}")) for name, run in systems.items()}
        for name, seconds in times.items():
            print(f"round {round_ + 1} | {name} | {seconds:.3f} s | {seconds / times['DDP']:.2f}x DDP", flush=True)


if __name__ == "__main__":
    main()
