"""`DeepSpeedEngine`: DeepSpeed's engine API over zerorun's Engine, using only the Engine's public API.

    engine, optimizer, _, scheduler = deepspeed.initialize(args=args, model=model, ...)
    loss = engine(batch)
    engine.backward(loss)
    engine.step()                       # an update at accumulation boundaries, then the lr schedule
    engine.save_checkpoint(dir, client_state={"epoch": 3})
    path, client_state = engine.load_checkpoint(dir)

What DeepSpeed does at a step, kept here: the lr schedule steps only after an applied update (not
after an fp16 overflow skipped it), `global_steps` counts skipped updates too, and the schedule's
state travels in the checkpoint. Checkpoint tags default to DeepSpeed's `global_step<N>`.
A method or attribute DeepSpeed has and this facade does not fails with an AttributeError that
names it and says what to use instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from zerorun.config import Recipe
from zerorun.errors import ZerorunError

COMPAT_STATE = "_deepspeed_compat"  # the facade's own entry in the checkpoint's client_state

# DeepSpeed engine members a script may reach for, with what zerorun offers instead.
INSTEAD = {
    "no_sync": "zerorun reduces gradients only at accumulation boundaries already; drop the context manager",
    "save_16bit_model": "engine.module.state_dict() (stages 0-2), engine.state_dict(), or `zerorun checkpoint "
                        "consolidate`",
    "save_fp16_model": "engine.state_dict(), or `zerorun checkpoint consolidate`",
    "train_batch": "a pipeline engine method; zerorun has no pipeline parallelism",
    "eval_batch": "a pipeline engine method; zerorun has no pipeline parallelism",
}


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every facade built in this process, for engine_owning


def engine_owning(params: Iterable[torch.Tensor]) -> Any:
    """The zerorun Engine whose model holds any of `params` (None: none does, e.g. before initialize)."""
    wanted = {id(p) for p in params}
    for facade in list(_LIVE):
        if any(id(p) in wanted for p in facade.engine.module.parameters()):
            return facade.engine
    return None


class DeepSpeedEngine:
    """The engine `deepspeed.initialize` returns, backed by a zerorun Engine."""

    def __init__(self, engine: Any, recipe: Recipe, lr_scheduler: Any = None,
                 ds: Mapping[str, Any] | None = None) -> None:
        self.engine = engine  # the zerorun Engine, for zerorun's own API (memory(), gathered(), ...)
        self.recipe = recipe
        self.config = dict(ds or {})  # the DeepSpeed config as trained (transformers reads it)
        self.optimizer = engine.optimizer
        self.optimizer.overflow = False  # DeepSpeed's optimizers say so after each step (accelerate reads it)
        self.lr_scheduler = lr_scheduler
        self.global_samples = 0
        self._step_applied = False
        info = engine.info
        self.local_rank, self.global_rank, self.world_size = info.local_rank, info.rank, info.world_size
        self.dp_world_size = info.world_size
        self.device = engine.device
        _LIVE.add(self)

    @property
    def module(self) -> torch.nn.Module:
        """The model, its parameters current (a deferred publish of the last step is waited for)."""
        self.engine.wait_published()
        return self.engine.module

    # -- training loop ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: Any, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """Backpropagate loss / gradient_accumulation_steps (or the loss as it is with scale_wrt_gas=False:
        transformers' Trainer divides it itself) and reduce at a boundary."""
        if retain_graph:
            raise ZerorunError("engine.backward(retain_graph=True) is not supported by zerorun: its gradient "
                               "hooks reduce once per backward.")
        # zerorun's engine always divides by train.grad_accum_steps: undo it for a loss already divided
        self.engine.backward(loss if scale_wrt_gas else loss * self.gradient_accumulation_steps())
        return loss

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """accelerate's loop: backward every micro-step, step() only where `is_boundary` (sync_gradients)."""
        self.engine.set_boundary(bool(is_boundary))

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """A micro-step; at a boundary, the update and then (if it was applied) the lr schedule."""
        if lr_kwargs:
            raise ZerorunError("engine.step(lr_kwargs=...) is not supported: zerorun's engine steps the lr "
                               "schedule itself, with no arguments, after every applied update.")
        boundary = self.engine.is_boundary
        skipped = self.engine.skipped_steps
        self.engine.step()
        if not boundary:
            return
        self._step_applied = self.engine.skipped_steps == skipped
        self.optimizer.overflow = not self._step_applied
        self.global_samples += self.train_batch_size()  # the engine stepped the lr schedule (if it applied)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_boundary

    def was_step_applied(self) -> bool:
        return self._step_applied

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        return self.train(False)

    @property
    def _modules(self) -> dict[str, torch.nn.Module]:
        """As DeepSpeed's engine, an nn.Module whose one child is the model (accelerate looks inside)."""
        return {"module": self.module}

    def modules(self) -> Any:
        return self.module.modules()

    def parameters(self, recurse: bool = True) -> Any:
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        return self.engine.state_dict()

    # -- what DeepSpeed's engine reports ------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self.engine.global_step

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        return [group["betas"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.engine.grad_norm

    def get_loss_scale(self) -> float:
        return self.engine.loss_scale

    def train_batch_size(self) -> int:
        return self.train_micro_batch_size_per_gpu() * self.gradient_accumulation_steps() * self.world_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.recipe.train.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.recipe.train.grad_accum_steps

    def gradient_clipping(self) -> float:
        return self.recipe.train.clip_grad_norm or 0.0

    def zero_optimization_stage(self) -> int:
        return self.recipe.zero.stage

    def zero_optimization(self) -> bool:
        return self.recipe.zero.stage > 0

    def fp16_enabled(self) -> bool:
        return self.recipe.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.recipe.precision.dtype == "bf16"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's default false): whether
        `save_model` may consolidate stage 3's weights (zerorun can; the config decides, as in DeepSpeed)."""
        zero = self.config.get("zero_optimization") or {}
        return bool(zero.get("stage3_gather_16bit_weights_on_model_save",
                             zero.get("gather_16bit_weights_on_model_save", False)))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The whole model's state dict on rank 0 in the model's dtype ({} on other ranks), as
        `trainer.save_model()` writes it; every rank must call it."""
        full = self.engine.state_dict()
        named = list(self.engine.module.named_parameters(remove_duplicate=False))
        frozen = {n for n, p in named if not p.requires_grad}
        dtypes = {n: p.dtype for n, p in named}
        out = {name: value.to(dtypes.get(name, value.dtype)) for name, value in full.items()
               if not (exclude_frozen_parameters and name in frozen)}
        first: dict[int, str] = {}
        for name, param in named:  # a tied weight is one tensor under each of its names, as in the model
            owner = first.setdefault(id(param), name)
            if owner != name and owner in out and name in out:
                out[name] = out[owner]
        return out

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save the whole training state sharded, with the lr schedule and `client_state`."""
        if not save_latest:
            raise ZerorunError("save_checkpoint(save_latest=False) is not supported: zerorun always points "
                               "`latest` at the newest complete checkpoint.")
        if exclude_frozen_parameters:
            raise ZerorunError("save_checkpoint(exclude_frozen_parameters=True) is not supported: zerorun "
                               "saves frozen parameters with the model.")
        state = dict(client_state or {})
        assert COMPAT_STATE not in state, f"client_state may not use the key {COMPAT_STATE!r} (zerorun's own)"
        state[COMPAT_STATE] = {"global_samples": self.global_samples}  # the engine saves the lr schedule
        self.engine.save_checkpoint(str(save_dir), tag or f"global_step{self.global_steps}", state)
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, dict | None]:
        """Restore everything; returns (checkpoint path, client_state), or (None, None) when there is none."""
        partial = {"load_module_strict=False": not load_module_strict,
                   "load_optimizer_states=False": not load_optimizer_states,
                   "load_module_only=True": load_module_only, "custom_load_fn": custom_load_fn is not None}
        refused = [name for name, given in partial.items() if given]
        if refused:
            raise ZerorunError(f"load_checkpoint({', '.join(refused)}) is not supported: zerorun restores the whole "
                               "training state; for weights alone, `zerorun checkpoint consolidate` and "
                               "load_state_dict.")
        kept = _schedule_state(self.lr_scheduler) if not load_lr_scheduler_states else None
        state = self.engine.load_checkpoint(str(load_dir), tag)
        if state is None:
            return None, None
        if kept is not None:  # the engine restored the schedule with everything else: put the current one back
            _set_schedule_state(self.lr_scheduler, kept)
        state = dict(state)
        own = state.pop(COMPAT_STATE, {})
        self.global_samples = own.get("global_samples", self.global_steps * self.train_batch_size())
        return str(Path(load_dir) / str(self.engine.resumed_from)), state

    def destroy(self) -> None:
        """DeepSpeed's `engine.destroy()`: the engine ends, and what it changed outside zerorun is undone
        (`Engine.destroy`, runtime/interop/)."""
        self.engine.destroy()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        hint = INSTEAD.get(name, "zerorun's Engine is engine.engine (memory(), gathered(), state_dict(), ...)")
        raise AttributeError(f"DeepSpeedEngine.{name} is not provided by zerorun's DeepSpeed compatibility: {hint}.")


def _schedule_state(scheduler: Any) -> tuple[dict[str, Any], list[float]] | None:
    if scheduler is None:
        return None
    return scheduler.state_dict(), [group["lr"] for group in scheduler.optimizer.param_groups]


def _set_schedule_state(scheduler: Any, kept: tuple[dict[str, Any], list[float]]) -> None:
    state, lrs = kept
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
