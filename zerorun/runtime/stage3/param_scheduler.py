"""When stage 3 gathers and releases: module hooks around forward and backward, with prefetch.

| moment                               | what happens                                                          |
|--------------------------------------|-----------------------------------------------------------------------|
| the root's forward starts            | the root unit and split units kept whole are gathered (kept through backward when grad is on) |
| a wrapped module's forward starts    | its unit is gathered; the next `prefetch_units` in the recorded order start gathering |
| it ends                              | released (not in backward: recomputation; nor a split unit held for backward) |
| gradients reach its outputs          | gathered again; the previous units in that order start gathering     |
| its group launched its gradients     | released (by the group itself, unit_group.py)                        |
| backward ends                        | everything but the persistent unit released, idle blocks handed back  |
| a step published (`overlap_comm`)    | the first `prefetch_units` of the order start gathering for the next forward |

The execution order is recorded on the first pass and re-recorded when it changes (that unit is then
gathered on demand). The first forward runs under `watch_first_pass`: a split unit (module_units.py)
whose parameters are used outside its own forward stays gathered for the whole pass, as the root.
Whether backward is running is the engine's `phase`, read here and by the gradient reducer alike.
The scheduler sees the pass (its order, what to prefetch, what the first pass keeps whole); each
group moves itself (unit_group.py), by its forgiving forms where a unit may legitimately be in more
than one state (a prefetched unit, a unit called twice), by its strict ones elsewhere. A group
releases itself once it has launched all its units' reduce-scatters; what the first pass keeps
whole is each group's `whole_pass`. The scheduler holds the plan and the buffers, not the store
that owns it: no reference cycle.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from zerorun.runtime.compiled import dynamo_loaded, eager_under_compile
from zerorun.runtime.phase import Phase, TrainingPhase
from zerorun.runtime.stage3.module_units import Stage3Plan
from zerorun.runtime.stage3.unit_buffers import UnitBuffers
from zerorun.runtime.stage3.unit_group import AROUND_USE, UnitGroup, UnitKind


class ParamScheduler:
    """Module hooks that gather, prefetch and release units around forward and backward."""

    def __init__(self, plan: Stage3Plan, buffers: UnitBuffers, prefetch: int, phase: TrainingPhase,
                 say: Callable[[str], None] | None = None) -> None:
        """`say` tells the user (rank 0) which split units the first pass keeps whole, and why."""
        self.plan, self.buffers, self.prefetch, self.phase, self.say = plan, buffers, prefetch, phase, say
        self.order: list[UnitGroup] | None = None  # forward execution order, recorded on the first pass
        self._observed: list[UnitGroup] = []
        self._backward_seen: set[UnitGroup] = set()
        self._hooks: list[RemovableHandle] = []
        self._inside: set[UnitGroup] = set()  # module units whose forward is running now (the first pass's watch)
        self._own_work = 0  # > 0 while a hook of this scheduler runs: its gathers are not the model's uses
        self.root = plan.root
        # what the first pass learns is each group's `whole_pass`: split units gathered for the whole pass, as the
        # root (all of them until the first pass has seen which are used outside their forward)
        self.kept_whole: list[str] = []  # split units the first pass saw used outside their forward
        for group in plan.gathered_units():
            self._hook(group.module, lambda group=group: self._before_forward(group),
                       lambda out, group=group: self._after_forward(group, out))
            owned = set(group.params)
            for sub in group.module.modules():  # submodules called on their own, outside their unit's forward
                if sub is not group.module and any(p in owned for p in sub._parameters.values()):
                    self._hook_inner(sub, group)
        self._hook(self.root.module, self._root_before, self._root_after)

    @property
    def in_own_hook(self) -> bool:
        """A hook of this scheduler runs now: what it gathers is not a use by the model."""
        return self._own_work > 0

    def inside(self, group: UnitGroup) -> bool:
        """`group`'s forward is running now."""
        return group in self._inside

    def _hook(self, module: torch.nn.Module, before: Callable[..., None], after: Callable[..., None]) -> None:
        """Hooks that run eagerly even inside a compiled forward: a gather or a release is a collective and a
        state change torch.compile cannot trace, so each is one graph break (docs/profiling-and-compiling.md)."""
        pre = eager_under_compile(lambda m, args: self._own(before))
        post = eager_under_compile(lambda m, args, out: self._own(after, out))
        self._hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _hook_inner(self, module: torch.nn.Module, group: UnitGroup) -> None:
        """Hooks on a submodule of a unit, for a call of it outside the unit's forward. Inside the unit's forward
        (where it is almost always called) they have nothing to do; under torch.compile they say so in a form
        dynamo traces (a guard on `_inside`), so a compiled unit is one graph, not one per submodule."""
        own = eager_under_compile(self._own)

        def skip() -> bool:
            return torch.compiler.is_compiling() and group in self._inside

        def before(m: torch.nn.Module, args: object) -> None:
            if not skip():
                own(group.ensure_gathered)

        def after(m: torch.nn.Module, args: object, out: object) -> None:
            if not skip():
                own(self._guard, group, out)
        self._hooks.append(module.register_forward_pre_hook(before))
        self._hooks.append(module.register_forward_hook(after))

    def _own(self, fn: Callable[..., None], *args: object) -> None:
        self._own_work += 1
        try:
            fn(*args)
        finally:
            self._own_work -= 1

    @property
    def _in_backward(self) -> bool:
        return self.phase.now is Phase.BACKWARD

    # -- forward --------------------------------------------------------------------------------
    def _root_before(self) -> None:
        if not self._in_backward:
            self._observed = []
        for group in self.plan.groups:  # the root, and split units gathered for the whole pass
            if group is self.root or group.whole_pass:
                group.ensure_gathered()

    def _root_after(self, out: object) -> None:
        if self._in_backward:
            return
        pinned = any(group.pinned for group in self.plan.groups)  # inside engine.gathered(): maybe one rank's pass
        if self._observed and self._observed != self.order and not pinned:
            self.order = list(self._observed)  # first pass, or the execution order changed: re-record
        self._guard(self.root, out)
        keep_root = torch.is_grad_enabled()  # backward will need the root (and shared) parameters
        for group in self.plan.groups:
            held = keep_root and (group.whole_pass or self._held_for_backward(group))
            if (group.kind in AROUND_USE and not held) or (group.kind is UnitKind.ROOT and not keep_root):
                group.release_if_held()  # prefetched ones too

    def _held_for_backward(self, group: UnitGroup) -> bool:
        """A split unit that stays gathered from its forward to its backward: one that ends the forward (an output
        head: backward starts with it), and one whose gather goes one way only (`UnitGroup.one_sided`, an embedding
        run by Muon): gathered again for the backward, its whole matrix would cross the link a second time from its
        owner, the one transfer of a step that no placement evens out (docs/optimizers.md)."""
        order = self.order or []
        if group.kind is not UnitKind.SPLIT or not torch.is_grad_enabled() or not order:
            return False
        return group is order[-1] or group.one_sided

    def _before_forward(self, group: UnitGroup) -> None:
        self._inside.add(group)
        if not self._in_backward:
            self._observed.append(group)
        group.ensure_gathered()  # a second call of the same unit, or one not prefetched
        if not self._in_backward and self.order is not None:
            position = len(self._observed) - 1
            if position < len(self.order) and self.order[position] is group:
                for nxt in self.order[position + 1:position + 1 + self.prefetch]:
                    nxt.prefetch()

    def _after_forward(self, group: UnitGroup, out: object) -> None:
        self._inside.discard(group)
        self._guard(group, out)
        # during backward this is checkpoint recomputation: backward needs them
        if not self._in_backward and not group.whole_pass and not self._held_for_backward(group) and not group.pinned:
            group.release()

    @contextlib.contextmanager
    def watch_first_pass(self) -> Iterator[None]:
        """Around the engine's forwards: the first one, while split units are still gathered for the whole
        pass, notes which split units' parameters are used outside their own forward; the others are
        gathered around their use from then on. A forward that raises decides nothing."""
        split = [] if self.order is not None else [group for group in self.plan.groups if group.whole_pass]
        if not split:
            yield
            return
        owner: dict[torch.Tensor, UnitGroup] = {p: group for group in split for p in group.params}
        outside: set[UnitGroup] = set()
        with _UseWatch(self, owner, outside), _eager_pass():
            yield
        for group in split:
            group.whole_pass = group in outside
        self.kept_whole = [group.name for group in split if group.whole_pass]
        if self.kept_whole and self.say is not None:
            self.say(kept_whole_message(self.kept_whole))

    # -- backward -------------------------------------------------------------------------------
    def _guard(self, group: UnitGroup, out: object) -> None:
        """Gather `group` again when gradients reach its outputs, before its backward runs."""
        if not torch.is_grad_enabled():
            return
        for tensor in _tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, group=group: self._before_backward(group))

    def _before_backward(self, group: UnitGroup) -> None:
        if group.all_sent:
            return  # its gradients are already on their way: a late hook (e.g. on a persistent submodule's output)
        group.ensure_gathered()
        if group in self._backward_seen or self.order is None or group not in self.order:
            return
        self._backward_seen.add(group)
        position = len(self.order) - 1 - self.order[::-1].index(group)
        for nxt in reversed(self.order[max(0, position - self.prefetch):position]):
            if nxt not in self._backward_seen:
                nxt.prefetch()

    def prefetch_next_forward(self) -> None:
        """After a step: start gathering the first `prefetch` units of the recorded order, so the next
        forward's first gathers overlap with what runs before it (a unit then not used is released
        with the others when that forward ends)."""
        for group in (self.order or [])[:self.prefetch]:
            group.prefetch()

    def begin_backward(self) -> None:
        self._backward_seen = set()

    def end_backward(self) -> None:
        for group in self.plan.groups:
            group.end_backward()
            if group.kind is not UnitKind.PERSISTENT:
                group.release_if_held()
        self.buffers.drop_idle_blocks()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _eager_pass() -> contextlib.AbstractContextManager:
    """The first pass runs eagerly even in a compiled model: dynamo would trace the watch's torch function mode
    into graphs that only this pass runs, and compile everything again for the next."""
    if not dynamo_loaded():
        return contextlib.nullcontext()
    stance: contextlib.AbstractContextManager = torch.compiler.set_stance("force_eager")
    return stance


def kept_whole_message(names: list[str]) -> str:
    return (f"zerorun: stage 3: {', '.join(names)} stay{'s' if len(names) == 1 else ''} gathered for the whole pass, "
            f"as the root unit: the first forward used {'its' if len(names) == 1 else 'their'} parameters outside "
            f"{'its' if len(names) == 1 else 'their'} own forward (e.g. by indexing a weight), where a released "
            "parameter would be read. Call the module instead to have it gathered around its use.")


class _UseWatch(TorchFunctionMode):
    """Notes split units (`owner`: parameter -> its group) whose parameters a torch function receives while
    their own forward is not running and no scheduler hook is (`outside` gets them)."""

    def __init__(self, scheduler: ParamScheduler, owner: dict[torch.Tensor, UnitGroup], outside: set[UnitGroup]) -> None:
        super().__init__()
        self.scheduler, self.owner, self.outside = scheduler, owner, outside

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.scheduler.in_own_hook:
            for leaf in tree_leaves((args, kwargs or {})):
                group = self.owner.get(leaf) if isinstance(leaf, torch.Tensor) else None
                if group is not None and not self.scheduler.inside(group):
                    self.outside.add(group)
        return func(*args, **(kwargs or {}))


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
