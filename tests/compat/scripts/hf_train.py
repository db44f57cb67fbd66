"""A plain Hugging Face Trainer script, as users write them: HfArgumentParser + TrainingArguments.

    torchrun --nproc-per-node 2 hf_train.py --model_dir M --record R --output_dir O ...   # DDP
    zerorun launch --num_gpus 2 hf_train.py --model_dir M ... --deepspeed ds.json       # zerorun's DeepSpeed

Nothing in it knows about zerorun: `--deepspeed ds.json` is transformers' own argument. The model
comes from a `save_pretrained` directory (`--model_dir`, written by the test: no download), the data
is synthetic token ids. Each rank writes its micro-step losses (what `training_step` returns) and
the learning rate and end time of each update to `<record>.rank<r>.json` (and, under zerorun, the most parameter
bytes it held while loading the model at stage 3).

`--ds_schedule` makes the DDP reference run follow DeepSpeed's WarmupDecayLR (linear warmup from 0,
linear decay to 0), stepped DeepSpeed's way: update k runs with the lr of iteration k - 1.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import weakref
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments


@dataclass
class ScriptArguments:
    model_dir: str
    record: str
    samples: int = 64
    seq: int = 16
    ds_schedule: bool = False


class TokenData(torch.utils.data.Dataset):
    def __init__(self, samples: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def deepspeed_warmup_decay(warmup: int, total: int):
    """DeepSpeed's WarmupDecayLR factor (warmup_min_lr 0, linear warmup) for update k, as its documentation gives it."""
    warmup = max(2, warmup)

    def factor(update: int) -> float:
        iteration = update - 1
        if iteration < 0:
            return 0.0
        if iteration < warmup:
            return iteration / warmup
        return max(0.0, (total - iteration) / max(1.0, total - warmup))

    return factor


class StepClock(TrainerCallback):
    """The time at the end of each update (the step-time benchmark reads their differences)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.ends.append(time.perf_counter())


class RecordingTrainer(Trainer):
    def __init__(self, *args, ds_schedule: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.ds_schedule = ds_schedule
        self.clock = StepClock()
        self.add_callback(self.clock)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(float(loss))
        return loss

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.ds_schedule and self.lr_scheduler is None:
            factor = deepspeed_warmup_decay(self.args.warmup_steps, num_training_steps)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def _get_learning_rate(self) -> float:
        lr = super()._get_learning_rate()
        self.lrs.append(float(lr))
        return lr


def staged_peak_bytes() -> int | None:
    """The most parameter bytes this rank held between zero.Init and initialize under zerorun (a probe the
    test reads; None where zerorun's DeepSpeed shim is not in use)."""
    staged = sys.modules.get("zerorun.compat.staged_params")
    return staged.peak_bytes() if staged is not None else None


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(script.model_dir, dtype=torch.float32)
    data = TokenData(script.samples, script.seq, model.config.vocab_size)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=data, ds_schedule=script.ds_schedule)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{script.record}.rank{rank}.json", "w") as file:
        json.dump({"losses": trainer.losses, "lrs": trainer.lrs, "global_step": trainer.state.global_step,
                   "staged_peak_bytes": staged_peak_bytes(),
                   "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
                   "deepspeed": getattr(sys.modules.get("deepspeed"), "__version__", None),
                   "step_ends": trainer.clock.ends}, file)
    if torch.distributed.is_initialized():
        end_together(trainer)


def end_together(trainer: Trainer) -> None:
    """Meet, destroy the group, then free the DDP wrapper while this function still holds the group.

    Left to the interpreter's exit, gloo aborts a rank whose peer is still mid-exchange ("terminate called without an
    active exception"), hence the barrier. And the group must not die with DDP: torch frees DDP's Reducer with the GIL
    held, and when the Reducer holds the group's last reference, gloo's destructor joins a worker thread that is
    waiting for the GIL to free a finished collective's tensors (1 run in 36 hung there, py-spy: ~ProcessGroupGloo in
    std::thread::join, the worker in decref_pyobject). The last reference dropped here goes the way torch
    releases the GIL first."""
    group = torch.distributed.group.WORLD
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    wrapped = weakref.ref(trainer.model_wrapped)
    trainer.accelerator.free_memory()
    trainer.model_wrapped = trainer.model
    gc.collect()
    assert wrapped() is None or not isinstance(wrapped(), torch.nn.parallel.DistributedDataParallel), "DDP outlived"
    del group


if __name__ == "__main__":
    main()
