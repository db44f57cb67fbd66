"""Stage 3's `ParamStore` as the engine holds it: the sharded store and the scheduler that drives it.

`ShardedParams` (sharded_params.py) knows how a unit is gathered and released; `ParamScheduler`
(param_scheduler.py) knows when, from module hooks. `ScheduledParams` is both, so the engine talks to
one `ParamStore` at every stage, and to this store alone as `UnitPasses` too: its forward context,
backward begin/end and hooks are the scheduler's work, which stages 0-2 do not have.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

from torch import nn

from zerorun.runtime.comm.collectives import Collectives
from zerorun.runtime.offload.placement import Placement
from zerorun.runtime.phase import TrainingPhase
from zerorun.runtime.precision import PrecisionPolicy
from zerorun.runtime.stage3.hpz import SecondaryPartition
from zerorun.runtime.stage3.module_units import Stage3Plan
from zerorun.runtime.stage3.param_scheduler import ParamScheduler
from zerorun.runtime.stage3.sharded_init import InitLog
from zerorun.runtime.stage3.sharded_params import ShardedParams


class ScheduledParams(ShardedParams):
    """`ShardedParams` with the `ParamScheduler` that gathers, prefetches and releases its units."""

    def __init__(self, model: nn.Module, plan: Stage3Plan, placement: Placement, policy: PrecisionPolicy,
                 comm: Collectives, init_log: InitLog | None, hpz: SecondaryPartition | None, *,
                 prefetch: int, phase: TrainingPhase, prefetch_after_step: bool,
                 say: Callable[[str], None] | None = None, state_kinds: list[tuple[str, ...]] | None = None) -> None:
        """`prefetch_after_step` (`zero.overlap_comm`): a step's publish starts gathering the next forward's
        first `prefetch` units; `say` tells the user (rank 0) what the first pass keeps whole."""
        super().__init__(model, plan, placement, policy, comm, init_log, hpz, state_kinds, phase.ranges)
        self.scheduler = ParamScheduler(plan, self.buffers, prefetch, phase, say)
        self.prefetch_after_step = prefetch_after_step

    def publish_after_step(self) -> None:
        super().publish_after_step()
        if self.prefetch_after_step:
            self.scheduler.prefetch_next_forward()

    def forward_context(self) -> AbstractContextManager:
        return self.scheduler.watch_first_pass()

    def begin_backward(self) -> None:
        self.scheduler.begin_backward()

    def end_backward(self) -> None:
        self.scheduler.end_backward()

    def remove_hooks(self) -> None:
        self.scheduler.remove()
        for group in self.groups:
            group.remove_hooks()
