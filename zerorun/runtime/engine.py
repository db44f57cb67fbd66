"""The engine: the user's face of the ZeRO runtime.

    engine = zerorun.initialize(model, optimizer)     # or optimizer=None for the recipe's
    for batch in data:
        loss = engine(batch)                           # forward
        engine.backward(loss)                          # scales by 1/grad_accum_steps (and the fp16 loss scale)
        engine.step()                                  # steps at accumulation boundaries only

An optimizer step, in order: the reducer has left this rank's summed gradient pieces; their
global L2 norm is one all-reduce of a scalar, which also tells every rank whether any rank saw
an inf/nan (then the step is skipped everywhere); the fused Adam divides by world size x loss
scale / clip coefficient in its own pass; the updated pieces are all-gathered into the
parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerorun.config import Recipe
from zerorun.errors import ZerorunError
from zerorun.runtime.collectives import Collectives
from zerorun.runtime import events, sharded_init
from zerorun.runtime.dist import init_distributed
from zerorun.runtime.flat import FlatParams, Unit
from zerorun.runtime.memory import MemoryReport, tensor_bytes
from zerorun.runtime.offload import HOST, HostHome, NvmeHome, OffloadedAdam, Piece, nvme_dir
from zerorun.runtime.optimizer import ShardedAdamW, param_groups_from
from zerorun.runtime.precision import LossScaler, PrecisionPolicy
from zerorun.runtime.stage12 import GradReducer
from zerorun.runtime.stage3 import ParamScheduler, ShardedParams, full_state_dict, gathered

log = logging.getLogger("zerorun")


class Engine:
    """Wraps a model and its optimizer in ZeRO stage 0, 1, 2 or 3."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, recipe: Recipe) -> None:
        self.recipe = recipe
        zero = recipe.zero
        self.info = init_distributed(recipe.launch.timeout_s)
        self.device = self.info.device
        self.stage = zero.stage
        self.policy = PrecisionPolicy.from_config(recipe.precision)
        self.scaler = LossScaler(recipe.precision)
        self.comm = Collectives()
        init_log = sharded_init.log_for(model)
        if init_log is not None and self.stage < 3:  # stages 0-2 hold whole parameters anyway
            init_log.replay(sharded_init.materialize, self.device)
            init_log = None
        self.module = _to_device(model, self.device)
        groups, decoupled = param_groups_from(optimizer, model, recipe.optimizer)
        self._sync_buffers()
        bucket_numel = max(1, int(zero.bucket_mb * 2**20 // 4))
        group_params = [g["params"] for g in groups]
        self.scheduler: ParamScheduler | None = None
        offloaded = zero.offload_optimizer.device != "none"
        master_device = HOST if offloaded else None  # the fp32 master goes where the CPU steps it
        if self.stage == 3:
            self.flat = ShardedParams(model, group_params, zero.wrap, zero.param_persistence_threshold,
                                      bucket_numel, self.policy, self.comm, self.device, init_log, master_device)
            self.scheduler = ParamScheduler(self.flat, zero.prefetch_units)
            # stage 3 reduces gradients like stage 2, per unit, as soon as backward completes one
            self.reducer = GradReducer(self.flat, 2, zero.overlap_comm, ordered=False,
                                       on_launch=self.scheduler.unit_reduced)
        else:
            shard_world = 1 if self.stage == 0 else self.comm.world_size
            self.flat = FlatParams(group_params, self.policy, self.comm, shard_world, bucket_numel, self.device,
                                   master_device)
            self.reducer = GradReducer(self.flat, self.stage, zero.overlap_comm)
        self._cast_frozen()
        state_device = {"none": self.device, "cpu": HOST, "nvme": None}[zero.offload_optimizer.device]
        self.optimizer = ShardedAdamW(groups, decoupled, self.flat.group_numels, state_device)
        self.offload: OffloadedAdam | None = None
        if offloaded:
            self.offload = self._build_offload()
        else:
            self._masters = [self.flat.master_pieces(g) for g in range(len(groups))]
            self._moments = [[(self.flat.state_slice(u, self.optimizer.exp_avg[g]),
                               self.flat.state_slice(u, self.optimizer.exp_avg_sq[g]))
                              for u in self.flat.units if u.group == g] for g in range(len(groups))]
            # stages 0-2 in bf16/fp16: the kernel writes the cast weights straight into the parameter
            # buffer; stage 3 casts when it gathers (it keeps no low-precision shard)
            lowp = [self.flat.lowp_pieces(g) for g in range(len(groups))] if self.stage < 3 else None
            self._lowp = lowp if lowp and all(p is not None for p in lowp) else None
        self.grad_accum_steps = recipe.train.grad_accum_steps
        self.clip_grad_norm = recipe.train.clip_grad_norm
        self.micro_steps = 0
        self.global_step = 0
        self.skipped_steps = 0
        self.grad_norm: float | None = None
        self.tokens_per_sample: int | None = None  # set it when inputs are not (batch, seq) token ids
        self._window = _StepWindow()

    # -- setup helpers ----------------------------------------------------------------------
    def _sync_buffers(self) -> None:
        """Every rank starts from rank 0's buffers (parameters are synced by FlatParams)."""
        for buffer in self.module.buffers():
            self.comm.broadcast(buffer, src=0).wait()

    def _cast_frozen(self) -> None:
        """Frozen parameters and floating buffers follow the compute dtype (they are not sharded)."""
        dtype = self.policy.param_dtype
        if dtype == torch.float32:
            return
        for param in self.module.parameters():
            if not param.requires_grad and param.is_floating_point():
                param.data = param.data.to(dtype)

    def _build_offload(self) -> OffloadedAdam:
        """Master and moments to their home (host memory or NVMe files); parameters stay where they are
        computed with, except stage 3's shard under `offload_param`."""
        zero = self.recipe.zero
        off = zero.offload_optimizer
        tile_numel = max(1024, int(off.buffer_mb * 2**20) // 4)
        if self.stage == 3:  # gathers read a compute-dtype shard; the master is the optimizer's alone
            param = zero.offload_param
            if param.device == "nvme":
                from zerorun.runtime.nvme import NvmeStore, check_nvme_path

                dtype = self.policy.param_dtype
                numels = self.flat.group_numels
                root = nvme_dir(param.nvme_path, self.recipe.name, self.info.rank) / "params"
                check_nvme_path(param.nvme_path, "zero.offload_param.nvme_path", dtype.itemsize * sum(numels), root)
                store = NvmeStore(root,
                                  {self.flat.param_file(g): n for g, n in enumerate(numels)},
                                  tile_numel=tile_numel, aio=zero.aio, pin=param.pin_memory, dtype=dtype)
                self.flat.use_param_store(store, param.pin_memory)
            else:
                self.flat.use_param_shard(HOST if param.device == "cpu" else self.device, param.pin_memory)
        if off.device == "cpu":
            home = HostHome(self.flat.master, self.optimizer.exp_avg, self.optimizer.exp_avg_sq)
        else:
            from zerorun.runtime.nvme import check_nvme_path  # builds the aio kernel: only when used

            root = nvme_dir(off.nvme_path, self.recipe.name, self.info.rank)
            check_nvme_path(off.nvme_path, "zero.offload_optimizer.nvme_path", 12 * sum(self.flat.group_numels), root)
            home = NvmeHome(root, self.flat.group_numels, tile_numel, zero.aio, off.pin_memory)
            for g, master in enumerate(self.flat.master):
                home.place(g, master)
            self.flat.master = None  # it lives on disk now; the store reads and writes it
            self.flat.master_home = home
        self._pieces = [[self._piece(g, u, grad, out)
                         for u, grad, out in zip([u for u in self.flat.units if u.group == g],
                                                 self.reducer.grad_pieces(g), self.flat.shard_pieces(g))]
                        for g in range(len(self.flat.group_numels))]
        return OffloadedAdam(self.optimizer, home, self.device, tile_numel, off.pin_memory)

    def _piece(self, group: int, unit: Unit, grad: torch.Tensor, out: torch.Tensor | None) -> Piece:
        piece = Piece(group, unit.state_offset, unit.layout.shard_numel, grad, out)
        if out is None:  # stage 3's parameter shard is in NVMe files: updates are written there
            piece.sink = lambda lo, values: self.flat.write_param_piece(group, unit.state_offset + lo, values)
            piece.sink_dtype = self.policy.param_dtype
        return piece

    # -- training loop ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; floating-point inputs are cast to the compute dtype."""
        dtype = self.policy.param_dtype
        if dtype != torch.float32:
            args, kwargs = _cast_floats((args, kwargs), dtype)
        self._window.count_inputs(args, kwargs, self.tokens_per_sample)
        return self.module(*args, **kwargs)

    @property
    def is_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window (the next step() updates)."""
        return (self.micro_steps + 1) % self.grad_accum_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss / grad_accum_steps` (times the loss scale) and reduce gradients."""
        self._window.add_loss(loss)
        self.reducer.begin_backward(reduce=self.is_boundary)
        if self.scheduler is not None:
            self.scheduler.begin_backward()
        try:
            (loss * (self.scaler.scale / self.grad_accum_steps)).backward()
        finally:
            self.reducer.end_backward()
            if self.scheduler is not None:
                self.scheduler.end_backward()

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary, update the parameters."""
        boundary = self.is_boundary
        self.micro_steps += 1
        if boundary:
            self._optimizer_step()
            self._maybe_checkpoint()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (steps already do this; for loops that skip a step)."""
        self.reducer.zero()

    def _optimizer_step(self) -> None:
        sum_divisor = self.comm.world_size * self.scaler.scale  # reduced gradients are sums of scaled grads
        grads = [self.reducer.grad_pieces(g) for g in range(len(self.flat.group_numels))]
        norm = self._global_norm(grads) / sum_divisor
        self.grad_norm = norm
        found_inf = not math.isfinite(norm)
        if found_inf:
            self.skipped_steps += 1
            log.warning("step %d skipped: inf/nan in gradients (loss scale %g)", self.global_step, self.scaler.scale)
        else:
            coef = 1.0
            if self.clip_grad_norm is not None:
                coef = min(1.0, self.clip_grad_norm / (norm + 1e-6))
            if self.offload is not None:
                self.offload.step(self._pieces, sum_divisor / coef)
                self.flat.publish(cast_done=True)
            else:
                self.optimizer.step_pieces(self._masters, grads, self._moments, sum_divisor / coef, self._lowp)
                self.flat.publish(cast_done=self._lowp is not None)
        self.scaler.update(found_inf)
        self.reducer.zero()
        self.global_step += 1
        offload = self.offload.stats() if self.offload is not None else {}
        events.emit(self._window.close(self.global_step, norm, self.scaler.scale, found_inf, self.skipped_steps,
                                       self.comm.stats.as_dict(), offload))

    def _global_norm(self, grads: list[list[torch.Tensor]]) -> float:
        """L2 norm of the summed gradients across all shards (inf/nan if any rank has one)."""
        pieces = [t for group in grads for t in group]
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        if pieces:
            local = torch.stack(torch._foreach_norm(pieces)).square().sum()
        if self.flat.shard_world > 1:
            self.comm.all_reduce(local, async_op=False).wait()
        return float(local.sqrt())

    # -- introspection ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def num_parameters(self) -> int:
        """Parameters of the whole model, each once, however sharded or offloaded (stage 3 and
        `sharded_init` included): the trainable ones the engine steps, plus frozen ones."""
        trainable = sum(unit.layout.numel for unit in self.flat.units)
        return trainable + sum(p.numel() for p in self.module.parameters() if not p.requires_grad)

    def memory(self) -> MemoryReport:
        """Bytes this rank holds, per kind of state and place."""
        place = self.device.type
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        report = MemoryReport()
        if self.scheduler is not None:  # stage 3: whatever units are gathered now (persistent ones at rest)
            report.add("params", place, self.flat.gathered_bytes() + tensor_bytes(frozen))
            if self.flat.param_shard is not None:
                report.add("params", self.flat.param_shard[0].device.type, tensor_bytes(self.flat.param_shard))
            if self.flat.param_store is not None:
                report.add("params", "nvme", self.policy.param_dtype.itemsize * sum(self.flat.group_numels))
                report.add("comm", HOST.type, self.flat.bounce_bytes())
        else:
            report.add("params", place, tensor_bytes([self.flat.flat]) + tensor_bytes(frozen))
        report.add("grads", place, self.reducer.held_bytes())
        report.add("buffers", place, tensor_bytes(list(self.module.buffers())))
        report.add("comm", place, self.reducer.pool.allocated_bytes)
        if self.offload is None:
            report.add("master", place, tensor_bytes(self.flat.master or []))
            report.add("optimizer", place, self.optimizer.held_bytes())
        else:
            for kind, places in self.offload.home.held_bytes().items():
                for where, nbytes in places.items():
                    report.add(kind, where, nbytes)
            report.add("comm", HOST.type, self.offload.transfers.held_bytes())
        return report

    def parameters(self) -> Any:
        return self.module.parameters()

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict: every rank in stages 0-2; stage 3 consolidates on rank 0 ({} elsewhere),
        one unit at a time, in fp32."""
        if self.scheduler is not None:
            return full_state_dict(self.module, self.flat)
        return self.module.state_dict()

    def gathered(self, params: Any = None, modify: bool = False, src: int = 0) -> Any:
        """Context manager: full parameters inside (stage 3; stages 0-2 always hold them).

        With `modify=True`, rank `src`'s values are written back to every rank's shard on exit.
        """
        if self.scheduler is None:
            return contextlib.nullcontext()
        return gathered(self.flat, params, modify, src)

    # -- checkpoints (runtime/checkpoint.py) -------------------------------------------------
    resumed_from: str | None = None  # the tag `resume()` or `load_checkpoint()` restored

    @property
    def client_state(self) -> dict:
        """The script's own state (data position, scheduler, ...): saved with every checkpoint, the
        recipe's `every_steps` saves included, and set from the checkpoint on resume."""
        return self.__dict__.setdefault("_client_state", {})

    @client_state.setter
    def client_state(self, value: dict) -> None:
        self._client_state = value

    def save_checkpoint(self, dir: str | None = None, tag: str | None = None,
                        client_state: dict | None = None) -> Path:
        """Save the whole training state, sharded (every rank calls it); `tag` defaults to `step-<global_step>`."""
        from zerorun.runtime import checkpoint

        state = self.client_state if client_state is None else client_state
        return checkpoint.save(self, self._checkpoint_dir(dir), tag or f"step-{self.global_step}", state)

    def load_checkpoint(self, dir: str | None = None, tag: str | None = None) -> dict | None:
        """Restore from `tag` (default: the latest); returns its client_state, or None when there is no checkpoint."""
        from zerorun.runtime import checkpoint

        loaded = checkpoint.load(self, self._checkpoint_dir(dir), tag)
        if loaded is None:
            return None
        self.resumed_from, self.client_state = loaded
        return self.client_state

    def resume(self) -> None:
        """What `checkpoint.resume` asks for: auto loads the latest checkpoint in `checkpoint.dir` if
        there is one; a tag loads that one; never does nothing (`zerorun.initialize` calls this)."""
        cfg = self.recipe.checkpoint
        if cfg.resume == "never" or (cfg.dir is None and cfg.resume == "auto"):
            return
        self.load_checkpoint(tag=None if cfg.resume == "auto" else cfg.resume)

    def _maybe_checkpoint(self) -> None:
        cfg = self.recipe.checkpoint
        if cfg.dir is not None and cfg.every_steps and self.global_step % cfg.every_steps == 0:
            self.save_checkpoint()

    def _checkpoint_dir(self, dir: str | None) -> str:
        dir = dir or self.recipe.checkpoint.dir
        if dir is None:
            raise ZerorunError("no checkpoint directory: pass dir=... or set checkpoint.dir in the recipe.")
        return dir


def _to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """Move parameters and buffers to `device`, leaving `sharded_init`'s meta parameters to the store."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
        for param in module._parameters.values():
            if param is not None and not param.is_meta and param.device != device:
                param.data = param.data.to(device)
    return model


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


class _StepWindow:
    """Accumulates what the micro-steps of one optimizer step did, for `events.StepStats`."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.started = time.perf_counter()
        self.losses: list[torch.Tensor] = []
        self.samples = 0
        self.tokens = 0

    def count_inputs(self, args: tuple, kwargs: dict, tokens_per_sample: int | None) -> None:
        """Samples = the first tensor's batch dimension; tokens = its numel when it holds token ids."""
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.ndim > 0), None)
        if first is None:
            return
        samples = first.shape[0]
        self.samples += samples
        if tokens_per_sample is not None:
            self.tokens += samples * tokens_per_sample
        elif not first.is_floating_point() and first.ndim >= 2:
            self.tokens += first.numel()

    def add_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())

    def close(self, step: int, norm: float, scale: float, skipped: bool, skipped_total: int,
              comm: dict[str, dict[str, float]], offload: dict[str, dict[str, float]]) -> events.StepStats:
        now = time.perf_counter()
        loss = torch.stack(self.losses).float().mean() if self.losses else None
        stats = events.StepStats(step, loss, norm, scale, skipped, skipped_total, now - self.started,
                                 self.samples, self.tokens, comm, offload)
        self._reset()
        return stats

