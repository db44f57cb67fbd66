"""The engine: the user's face of the ZeRO runtime.

    engine = zerorun.initialize(model, optimizer)     # or optimizer=None for the recipe's; or a list of them
    for batch in data:
        loss = engine(batch)                           # forward
        engine.backward(loss)                          # scales by 1/grad_accum_steps (and the fp16 loss scale)
        engine.step()                                  # steps at accumulation boundaries only

A thin facade over collaborators, each built once from the recipe: a `Placement` (placement.py: where the optimizer
state and stage 3's shard live); a `ParamStore` (store.py: `FlatParams` at stages 0-2, `ScheduledParams` at stage 3,
also the engine's `UnitPasses`); the `GradReducer` (grad_reducer.py: this rank's summed gradient pieces); the
`Update` (optim/update.py: every param group's optimizer and its state, run the way each needs); `InFlight`
(in_flight.py: what an update leaves running, settled in one place, `@settles`); the `TrainingPhase` (phase.py) the
reducer and the scheduler read; the `EnginePlace` (engine_place.py) every collective's tag reports. The engine lives
in a `Runtime` (context.py: its listeners, ranges, saves in flight, segments), handed to whatever needs it.

An optimizer step: the global L2 norm of the gradient pieces (one all-reduce of a scalar, which also
tells every rank whether any rank saw an inf/nan: then the step is skipped everywhere); the update,
dividing the gradients by world size x loss scale / clip coefficient as it runs; the store's publish.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerorun.config import Recipe
from zerorun.errors import ZerorunError
from zerorun.runtime import compiled, context, events, script_settings
from zerorun.runtime.accumulation import AccumulationWindow
from zerorun.runtime.checkpoint import background as checkpoint_async
from zerorun.runtime.checkpoint.background import Checkpointer
from zerorun.runtime.comm.collectives import Collectives
from zerorun.runtime.comm.dist import init_distributed
from zerorun.runtime.devices import place_inputs, to_device
from zerorun.runtime.engine_place import Activity, EnginePlace
from zerorun.runtime.events import StepWindow
from zerorun.runtime.grad_reducer import GradReducer
from zerorun.runtime.in_flight import InFlight, Need, settles
from zerorun.runtime.interop import Interop, schedulers_of
from zerorun.runtime.memory import MemoryReport, tensor_bytes
from zerorun.runtime.offload.placement import Placement
from zerorun.runtime.optim import clip
from zerorun.runtime.optim.lr_schedules import LrSchedules
from zerorun.runtime.optim.optimizer import ShardedOptimizer
from zerorun.runtime.optim.overlap import overlaps
from zerorun.runtime.optim.recipe_optimizers import from_recipe
from zerorun.runtime.optim.take_over import EngineGroup, given_optimizers, take_over
from zerorun.runtime.optim.update import Update
from zerorun.runtime.optim.ways import Way
from zerorun.runtime.phase import Phase, TrainingPhase
from zerorun.runtime.precision import LossScaler, PrecisionPolicy
from zerorun.runtime.stage3 import sharded_init
from zerorun.runtime.stage_setup import Stage, build_stage, cast_frozen
from zerorun.runtime.store import ParamStore, UnitPasses, first_names

log = logging.getLogger("zerorun")


class Engine:
    """Wraps a model and its optimizers in ZeRO stage 0, 1, 2 or 3."""

    def __init__(self, model: nn.Module, optimizer: Any, recipe: Recipe, lr_scheduler: Any = None,
                 scheduler_source: str | None = None, runtime: context.Runtime | None = None) -> None:
        """`optimizer`: a torch optimizer, a list of them over disjoint parameters, or None (the recipe's).
        `lr_scheduler`: stepped by the engine after every applied update (a scheduler, or a function of the
        engine's optimizer that makes one); `scheduler_source` names where the recipe set it. `runtime`: where
        the engine lives (runtime/context.py; None: this thread's)."""
        self.recipe, self.runtime = recipe, runtime or context.current()
        self._build_runtime(recipe)
        setup = partial(events.EngineSetup, host_memory=recipe.zero.host_memory, stage=self.stage,
                        device_type=self.device.type)
        self.runtime.events.emit_setup(setup(done=False))  # process-wide tuning (the worker's host_allocator) follows
        init_log = self._take_model(model)
        handed_over = given_optimizers(optimizer)
        groups = take_over(handed_over or from_recipe(recipe.optimizer, model), model, self.device)
        self._sync_buffers()
        # the torch Optimizer face: every handed-over param group; it and the schedulers are refused before any hook
        self.optimizer = ShardedOptimizer([g.hyper for g in groups], list(dict.fromkeys(g.optimizer for g in groups)))
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(self.optimizer)
        self.lr_schedules = LrSchedules(self.optimizer, handed_over, schedulers_of, lr_scheduler, scheduler_source)
        stage = build_stage(recipe, model, groups, init_log, self.comm, self.placement, self.policy, self.phase,
                            self.device, self.compiled)
        self.store: ParamStore = stage.store
        self.passes: UnitPasses | None = stage.passes  # stage 3's gather and release around every pass
        self.reducer: GradReducer = stage.reducer
        cast_frozen(self.module, self.policy.param_dtype)
        grads = [self.reducer.grad_pieces(g) for g in range(len(groups))]
        self.update = Update(groups, self.optimizer, self.store, grads, self.placement, self.comm,
                             first_names(self.model), self.runtime.ranges)  # every group's update and state
        self._overlap_optimizer(groups)
        if self.comm.rank == 0 and self.update.ways() is not None:
            print(self.update.ways(), flush=True)
        self._loop_state(recipe)
        self.checkpoints = Checkpointer(self, self.runtime)  # saves: in the background, at most one in flight
        self.checkpoints.clean_start()
        self.deferred = stage.deferred  # stages 1/2 with zero.overlap_publish: the publish the next forward waits for
        self.in_flight = InFlight(self.update, self.deferred)
        # last, so that an engine that failed to build changed nothing outside zerorun (runtime/interop/)
        self.interop = Interop(self)
        self._install_interop(model, stage, handed_over)
        self.runtime.events.emit_setup(setup(done=True))

    # -- setup helpers ----------------------------------------------------------------------
    def _build_runtime(self, recipe: Recipe) -> None:
        """The process group, device, precision policy, collectives, phase and placement."""
        self.info = init_distributed(recipe.launch.timeout_s)
        self.device = self.info.device
        self.stage = recipe.zero.stage
        self.policy = PrecisionPolicy.from_config(recipe.precision, recipe.zero.reduce_dtype)
        self.scaler = LossScaler(recipe.precision)
        self.comm = Collectives(cpu=recipe.zero.cpu_collectives, timeout_s=recipe.launch.timeout_s,
                                quantized_gradients=recipe.zero.quantized_gradients,
                                quantized_weights=recipe.zero.quantized_weights, device=self.device,
                                runtime=self.runtime)
        self.phase = TrainingPhase(self.runtime.ranges)
        self.where = EnginePlace(self.phase, self, self.comm)  # every collective's tag says where its caller stands
        self.script_settings = script_settings.watch(recipe, self.policy.param_dtype, self.comm.rank)
        self.placement = Placement.from_recipe(recipe, self.device, self.info.rank)

    def _take_model(self, model: nn.Module) -> sharded_init.InitLog | None:
        """The model on the engine's device; the `sharded_init` log stage 3 replays (None: nothing to replay)."""
        self.compiled = compiled.inspect(model)  # what the script compiled with torch.compile, if anything
        self._dynamo_seen = compiled.dynamo_loaded()  # else the first forward after dynamo loads checks for a compile
        init_log = self.runtime.part(sharded_init.InitLogs).log_for(model)
        if init_log is not None and self.stage < 3:  # stages 0-2 hold whole parameters anyway
            init_log.replay(sharded_init.materialize, self.device)
            init_log = None
        self.module = to_device(model, self.device)  # what a forward calls: compiled, when the script compiled it
        # whose names checkpoints and state dicts use: the model's own, compiled or not (torch.compile adds `_orig_mod.`)
        self.model = compiled.unwrapped(self.module)
        return init_log

    def _overlap_optimizer(self, groups: list[EngineGroup]) -> None:
        """`zero.overlap_optimizer`: fused and owner-way updates under the backward (optim/overlap.py)."""
        say = (lambda text: log.warning("%s", text)) if self.comm.rank == 0 else None
        under = [g for g, group in enumerate(groups) if group.way in (Way.FUSED_ADAM, Way.OWNER)]
        if under and overlaps(self.recipe.zero.overlap_optimizer, self.recipe.zero.offload_optimizer.device,
                              sum(self.store.group_numels[g] for g in under), self.device, say):
            self.reducer.on_reduced = self.update.overlap_with_backward(say).unit_reduced

    def _loop_state(self, recipe: Recipe) -> None:
        """The training loop's counters, accumulation window and the script's clip calls."""
        self.grad_accum_steps = recipe.train.grad_accum_steps
        self.clip_grad_norm = recipe.train.clip_grad_norm
        self.window = AccumulationWindow()
        self.clip_calls = clip.ScriptClipping(self.grad_accum_steps)  # the script's clip_grad_norm_/value_ calls
        self.micro_steps = self.skipped_steps = 0
        self.global_step: int = self.update.steps_taken()  # a handed-over optimizer's count (its own checkpoint's)
        self.grad_norm: float | None = None
        self._boundary: bool | None = None  # set_boundary's answer; None: every grad_accum_steps-th micro-step
        self.tokens_per_sample: int | None = None  # set it when inputs are not (batch, seq) token ids
        self._window = StepWindow()
        # the script's own state (data position, ...): saved with every checkpoint, set from the checkpoint on resume
        self.client_state: dict = {}

    def _install_interop(self, model: nn.Module, stage: Stage, handed_over: list[torch.optim.Optimizer]) -> None:
        """What the engine changes outside zerorun: hooks, guards, the clip functions (runtime/interop/)."""
        self.interop.take_over(self, model)
        for hooks in (self.reducer, self.passes, self.deferred):
            if hooks is not None:
                self.interop.remove_with_engine(hooks.remove_hooks)
        if self.deferred is not None:
            self.interop.guard_parameter_reads(model, self.deferred.wait_all)
        self.interop.guard_optimizers(self, handed_over)
        if self.stage == 3:  # the model's own state_dict() gathers (never a closure over the engine: the hook lives on)
            self.interop.gather_state_dicts(self.model, partial(self.where.gathered_state, self.store, self.comm))
        self.interop.route_clip_calls(self)
        self.where.built(self.model, [u.params for u in self.store.units])

    def _sync_buffers(self) -> None:  # every rank starts from rank 0's buffers (the store syncs parameters)
        for buffer in self.module.buffers():
            self.comm.broadcast(buffer, src=0).wait()

    # -- training loop ----------------------------------------------------------------------
    @settles(Need.STATE)  # the parameters may still be landing: each module's hook waits for its own
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module: tensor inputs go to the engine's device (as FSDP's root does), floats to compute dtype."""
        self.lr_schedules.engine_entered()
        self.script_settings.forward(self.global_step, self.device)  # its autocast, its step count: the recipe's?
        args, kwargs = place_inputs((args, kwargs), self.device, self.policy.param_dtype)
        self._window.count_inputs(args, kwargs, self.tokens_per_sample)
        if not self._dynamo_seen and compiled.dynamo_loaded():
            self._dynamo_seen = True
            compiled.refuse_compiled_since(self.compiled, self.module)
        if self.compiled.whole or self.compiled.parts:  # the publish's per-module waits: graph breaks if compiled
            self.wait_published()
        around = self.passes.forward_context() if self.passes is not None else contextlib.nullcontext()
        with self.phase.running(Phase.FORWARD), around:
            out = self.module(*args, **kwargs)
        self._window.note_outputs(out)  # the loss the model computed: telemetry's, however the script scales it
        self.wait_published()  # a unit no module hook waited for (unused in this forward) is current from here on
        return out

    __call__ = forward

    def wait_published(self) -> None:
        """Wait until the last step's updated parameters have reached every rank (stages 1/2 with
        `overlap_publish` publish them under the next forward). The engine's own methods, forwards and
        `state_dict()` calls do this themselves; call it before reading `p.data` right after `step()`."""
        self.in_flight.wait_published()

    @property
    def is_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window (the next step() updates)."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.grad_accum_steps == 0

    def set_boundary(self, boundary: bool | None) -> None:
        """Whether the coming backward and step end an accumulation window, for loops that decide it
        themselves (accelerate's `sync_gradients`: backward every micro-step, step() at the boundary only);
        None returns to every `grad_accum_steps`-th micro-step. The loss is still divided by grad_accum_steps."""
        self._boundary = boundary

    @settles(Need.PARAMETERS)  # the forward may have run on the module itself, outside the engine
    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss / grad_accum_steps` (times the loss scale) and reduce gradients."""
        self.lr_schedules.engine_entered()
        reduce = self.is_boundary and not self.window.unsynced
        # with set_boundary the loop counts its window itself (accelerate: backward per micro-batch, one step)
        accum = self.grad_accum_steps if self._boundary is None else 1
        self.window.check_backward(accum, self.stage, self.recipe.given.get("train.grad_accum_steps"))
        self._window.add_loss(loss)
        self.window.backward_started(reduce or self.stage >= 2)
        self.clip_calls.gradients_changed()
        with self.phase.running(Phase.BACKWARD):
            self.reducer.begin_backward(reduce=reduce)
            if self.passes is not None:
                self.passes.begin_backward()
            if reduce and self.update.speculates:  # the window's last backward: its units' updates can start
                self.checkpoints.before_update()  # a background save must have captured the state first
                self.update.speculate(self.comm.world_size * self.scaler.scale)
            try:
                (loss * (self.scaler.scale / self.grad_accum_steps)).backward()
            finally:
                self.reducer.end_backward()
                if self.passes is not None:
                    self.passes.end_backward()

    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary, update the parameters."""
        self.lr_schedules.engine_entered()
        boundary = self.is_boundary
        self.window.check_step(boundary, self.stage)
        self.micro_steps += 1
        if boundary:
            with self.phase.running(Phase.STEP):
                found_inf, norm = self._optimizer_step()
            self.global_step += 1
            if not found_inf:
                self.lr_schedules.update_applied()
            self.lr_schedules.update_ended()
            self.runtime.events.emit(self._window.close(self.global_step, norm, self.scaler.scale, found_inf,
                                                        self.skipped_steps, self.comm.stats.as_dict(), self.update.stats()))
            with self.where.doing(Activity.CHECKPOINT):
                if self.checkpoints.due(self.global_step):
                    with self.lr_schedules.saving_inside_step():
                        self.save_checkpoint()
                self.checkpoints.poll()  # a background save's failure ends training here

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside do not reduce gradients at stages 0-1 (they accumulate on this rank), as
        DDP's `no_sync`: for a script that accumulates itself (`train.grad_accum_steps: 1`, several
        `engine.backward()` per `engine.step()`). Stages 2-3 reduce-scatter every micro-batch regardless."""
        self.window.unsynced = True
        try:
            yield
        finally:
            self.window.unsynced = False

    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the model's parameters, done by the engine (optim/clip.py): the
        update of this window is clipped to `max_norm` by the global norm over every shard. Returns that
        norm (nan before the window's last backward, when it is not known yet)."""
        return self.clip_calls.norm(self, parameters, max_norm, norm_type, error_if_nonfinite,
                              self.window.complete(self.is_boundary),
                              lambda: self._global_norm() / (self.comm.world_size * self.scaler.scale))

    def clip_grad_value_(self, parameters: list[torch.Tensor], clip_value: float) -> None:
        """`torch.nn.utils.clip_grad_value_` over the model's parameters: the window's averaged gradients are
        clamped to [-clip_value, clip_value] before the update (and before its norm)."""
        self.clip_calls.value(self, parameters, clip_value)

    @settles(Need.STATE)
    def zero_grad(self) -> None:
        """Drop accumulated gradients (steps already do this; for loops that skip a step)."""
        self.reducer.zero()
        self.window.reset()

    def _optimizer_step(self) -> tuple[bool, float]:
        """Update from the reduced gradients unless any rank overflowed; (skipped, global norm)."""
        self.in_flight.wait_published()  # the update writes into the pieces the last publish sends
        self.checkpoints.before_update()  # a background save must have captured the state it changes
        self.update.wait_speculation()  # the host's updates under the backward read the gradients until here
        sum_divisor = self.comm.world_size * self.scaler.scale  # reduced gradients are sums of scaled grads
        call = self.clip_calls.take()
        if call.value is not None:
            for piece in self.update.grads():
                piece.clamp_(-call.value * sum_divisor, call.value * sum_divisor)
        norm = call.norm if call.norm is not None and call.value is None else self._global_norm() / sum_divisor
        self.grad_norm = norm
        found_inf = not math.isfinite(norm)
        if found_inf:
            self.skipped_steps += 1
            log.warning("step %d skipped: inf/nan in gradients (loss scale %g)", self.global_step, self.scaler.scale)
        else:
            max_norm = call.max_norm if call.max_norm is not None else self.clip_grad_norm
            coef = 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))
            self.update.apply(sum_divisor / coef, clamped=call.value is not None)
            with self.runtime.ranges.named("publish"):
                self.store.publish_after_step()
        self.update.settle("skipped" if found_inf else "read")  # Need.STATE: a skipped step's speculation is undone
        self.scaler.update(found_inf)
        self.optimizer.count_step()  # skipped or not, scheduler.step() after engine.step() is the right order
        self.reducer.zero()
        self.window.reset()
        return found_inf, norm

    def _global_norm(self) -> float:
        """L2 norm of the summed gradients across all shards (inf/nan if any rank has one)."""
        pieces = self.update.grads()
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        if pieces:
            # in fp32 whatever the reduce dtype: a bf16 norm is off by up to 2^-8, and clipping with it too
            local = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float32)).square().sum()
        if self.store.shard_world > 1:
            self.comm.all_reduce(local, async_op=False).wait()
        return float(local.sqrt())

    def destroy(self) -> None:
        """End the engine: a save in flight commits, collectives in flight finish, and all it changed outside zerorun
        is undone (clip functions, the root's class, optimizers, hooks: runtime/interop/). Build nothing on it after."""
        self.checkpoints.wait()
        self.store.settle()
        self.interop.remove()

    # -- introspection ----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def num_parameters(self) -> int:
        """Parameters of the whole model, each once, however sharded or offloaded (stage 3 and
        `sharded_init` included): the trainable ones the engine steps, plus frozen ones."""
        trainable = sum(unit.layout.numel for unit in self.store.units)
        return trainable + sum(p.numel() for p in self._frozen_parameters())

    def memory(self) -> MemoryReport:
        """Bytes this rank holds, per kind of state and place (and, at stage 3, how many units it made)."""
        place = self.device.type
        report = MemoryReport()
        self.store.account(report)
        report.add("params", place, tensor_bytes(self._frozen_parameters()))
        report.add("buffers", place, tensor_bytes(list(self.module.buffers())))
        self.reducer.account(report)
        self.update.account(report)
        self.checkpoints.account(report)
        return report

    def _frozen_parameters(self) -> list[nn.Parameter]:
        """The module's frozen parameters, found without the root's guarded `named_parameters()`: counting
        sizes needs no values, and the telemetry thread calls this while a publish may be in flight."""
        return [p for _, p in nn.Module.named_parameters(self.module) if not p.requires_grad]

    @settles(Need.PARAMETERS)
    def parameters(self) -> Any:
        return self.module.parameters()

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @settles(Need.PARAMETERS)
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full state dict, trainable parameters in fp32 (the master weights) at every stage and
        precision: on every rank at stages 0-2; stage 3 consolidates on rank 0 ({} elsewhere), one unit at a
        time. Buffers and frozen parameters are as the module holds them."""
        with self.where.doing(Activity.STATE_DICT):
            return self.store.full_state_dict(self.model)

    @settles(Need.PARAMETERS)
    def gathered(self, params: Any = None, modify: bool = False, src: int = 0) -> Any:
        """Context manager: full parameters inside (stage 3; stages 0-2 always hold them). With `modify=True`, rank
        `src`'s values are written back to every rank's shard on exit."""
        if modify:
            self.checkpoints.before_update()
        return self.where.around(Activity.GATHERED, self.store.gathered(params, modify, src))

    # -- checkpoints (runtime/checkpoint/sharded.py) -------------------------------------------------
    resumed_from: str | None = None  # the tag `resume()` or `load_checkpoint()` restored

    @settles(Need.PARAMETERS)
    def save_checkpoint(self, dir: str | None = None, tag: str | None = None, client_state: dict | None = None,
                        block: bool = False) -> Path:
        """Save the whole training state, sharded (every rank calls it); `tag` defaults to `step-<global_step>`.

        With `checkpoint.async_save` (the default) it returns once the state is snapshotted and the files
        are written in the background; `latest` moves when every rank's files are durable. `block=True`
        (or `wait_checkpoint()`) waits for that."""
        state = self.client_state if client_state is None else client_state
        with self.runtime.ranges.named("checkpoint snapshot"), self.where.doing(Activity.CHECKPOINT):
            return self.checkpoints.save(self._checkpoint_dir(dir), tag or f"step-{self.global_step}", state, block)

    def wait_checkpoint(self) -> None:
        """Wait until the save in flight (if any) is committed; raise its error, if it failed."""
        with self.where.doing(Activity.CHECKPOINT):  # a collective: every rank calls it
            self.checkpoints.wait()

    @settles(Need.PARAMETERS)  # loading writes the pieces an unfinished publish may still be sending
    def load_checkpoint(self, dir: str | None = None, tag: str | None = None) -> dict | None:
        """Restore from `tag` (default: the latest); returns its client_state, or None when there is no checkpoint."""
        from zerorun.runtime.checkpoint import sharded as checkpoint

        checkpoint_async.wait_all(self.runtime)  # and what a save in flight reads; `latest` is final once it commits
        with self.where.doing(Activity.CHECKPOINT):
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

    def _checkpoint_dir(self, dir: str | None) -> str:
        dir = dir or self.recipe.checkpoint.dir
        if dir is None:
            raise ZerorunError("no checkpoint directory: pass dir=... or set checkpoint.dir in the recipe.")
        return dir

