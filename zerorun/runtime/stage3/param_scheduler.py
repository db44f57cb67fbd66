"""When stage 3 gathers and releases: module hooks around forward and backward, with prefetch.

| moment                               | what happens                                                          |
|--------------------------------------|-----------------------------------------------------------------------|
| the root's forward starts            | the root unit and split units kept whole are gathered (kept through backward when grad is on) |
| a wrapped module's forward starts    | its unit is gathered; the next `prefetch_units` in the recorded order start gathering |
| it ends                              | released (not in backward: recomputation; nor a split unit kept whole or ending the forward) |
| gradients reach its outputs          | gathered again; the previous units in that order start gathering     |
| the reducer launched its gradients   | released                                                              |
| backward ends                        | everything but the persistent unit released, idle blocks handed back  |
| a step published (`overlap_comm`)    | the first `prefetch_units` of the order start gathering for the next forward |

The execution order is recorded on the first pass and re-recorded when it changes (that unit is then
gathered on demand). The first forward runs under `watch_first_pass`: a split unit (module_units.py)
whose parameters are used outside its own forward stays gathered for the whole pass, as the root.
Whether backward is running is the engine's `phase`, read here and by the
gradient reducer alike. The store's forgiving helpers are used where a unit may legitimately be in
more than one state (a prefetched unit, a unit called twice); the strict ones elsewhere.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from zerorun.runtime.stage3.module_units import AROUND_USE, ModuleUnit, UnitKind
from zerorun.runtime.phase import Phase, TrainingPhase
from zerorun.runtime.stage3.sharded_params import ShardedParams


class ParamScheduler:
    """Module hooks that gather, prefetch and release units around forward and backward."""

    def __init__(self, store: ShardedParams, prefetch: int, phase: TrainingPhase,
                 say: Callable[[str], None] | None = None) -> None:
        """`say` tells the user (rank 0) which split units the first pass keeps whole, and why."""
        self.store, self.prefetch, self.phase, self.say = store, prefetch, phase, say
        self.order: list[ModuleUnit] | None = None  # forward execution order, recorded on the first pass
        self._observed: list[ModuleUnit] = []
        self._backward_seen: set[ModuleUnit] = set()
        self._reduced: set[int] = set()
        self._hooks: list[RemovableHandle] = []
        self._inside: set[ModuleUnit] = set()  # module units whose forward is running now (the first pass's watch)
        self._own_work = 0  # > 0 while a hook of this scheduler runs: its gathers are not the model's uses
        self.root = store.plan.root
        # what the first pass learns, not written back into the plan: split units gathered for the whole
        # pass, as the root (all of them until the first pass has seen which are used outside their forward)
        self.whole_pass: set[ModuleUnit] = {mu for mu in store.module_units if mu.kind is UnitKind.SPLIT}
        self.kept_whole: list[str] = []  # split units the first pass saw used outside their forward
        for mu in store.plan.gathered_units():
            self._hook(mu.module, lambda mu=mu: self._before_forward(mu),
                       lambda out, mu=mu: self._after_forward(mu, out))
            owned = {p for k in mu.units for p in store.units[k].params}
            for sub in mu.module.modules():  # submodules called on their own, outside their unit's forward
                if sub is not mu.module and any(p in owned for p in sub._parameters.values()):
                    self._hook(sub, lambda mu=mu: store.ensure_gathered(mu), lambda out, mu=mu: self._guard(mu, out))
        self._hook(self.root.module, self._root_before, self._root_after)

    def _hook(self, module: torch.nn.Module, before: Callable[..., None], after: Callable[..., None]) -> None:
        self._hooks.append(module.register_forward_pre_hook(lambda m, args: self._own(before)))
        self._hooks.append(module.register_forward_hook(lambda m, args, out: self._own(after, out)))

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
        for mu in self.store.module_units:  # the root, and split units gathered for the whole pass
            if mu is self.root or mu in self.whole_pass:
                self.store.ensure_gathered(mu)

    def _root_after(self, out: object) -> None:
        if self._in_backward:
            return
        if self._observed and self._observed != self.order:
            self.order = list(self._observed)  # first pass, or the execution order changed: re-record
        self._guard(self.root, out)
        keep_root = torch.is_grad_enabled()  # backward will need the root (and shared) parameters
        for mu in self.store.module_units:
            held = keep_root and (mu in self.whole_pass or self._first_in_backward(mu))
            if (mu.kind in AROUND_USE and not held) or (mu.kind is UnitKind.ROOT and not keep_root):
                self.store.release_if_held(mu)  # prefetched ones too

    def _first_in_backward(self, mu: ModuleUnit) -> bool:
        """A split unit that ends the forward (an output head) stays for backward, which starts with it."""
        order = self.order or []
        return mu.kind is UnitKind.SPLIT and torch.is_grad_enabled() and bool(order) and mu is order[-1]

    def _before_forward(self, mu: ModuleUnit) -> None:
        self._inside.add(mu)
        if not self._in_backward:
            self._observed.append(mu)
        self.store.ensure_gathered(mu)  # a second call of the same unit, or one not prefetched
        if not self._in_backward and self.order is not None:
            position = len(self._observed) - 1
            if position < len(self.order) and self.order[position] is mu:
                for nxt in self.order[position + 1:position + 1 + self.prefetch]:
                    self.store.prefetch(nxt)

    def _after_forward(self, mu: ModuleUnit, out: object) -> None:
        self._inside.discard(mu)
        self._guard(mu, out)
        # during backward this is checkpoint recomputation: backward needs them
        if not self._in_backward and mu not in self.whole_pass and not self._first_in_backward(mu):
            self.store.release(mu)

    @contextlib.contextmanager
    def watch_first_pass(self) -> Iterator[None]:
        """Around the engine's forwards: the first one, while split units are still gathered for the whole
        pass, notes which split units' parameters are used outside their own forward; the others are
        gathered around their use from then on. A forward that raises decides nothing."""
        split = [] if self.order is not None else [mu for mu in self.store.module_units if mu in self.whole_pass]
        if not split:
            yield
            return
        owner = {id(p): mu for mu in split for k in mu.units for p in self.store.units[k].params}
        outside: set[ModuleUnit] = set()
        with _UseWatch(self, owner, outside):
            yield
        self.whole_pass = {mu for mu in split if mu in outside}
        self.kept_whole = [mu.name for mu in split if mu in self.whole_pass]
        if self.kept_whole and self.say is not None:
            self.say(kept_whole_message(self.kept_whole))

    # -- backward -------------------------------------------------------------------------------
    def _guard(self, mu: ModuleUnit, out: object) -> None:
        """Gather `mu` again when gradients reach its outputs, before its backward runs."""
        if not torch.is_grad_enabled():
            return
        for tensor in _tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, mu=mu: self._before_backward(mu))

    def _before_backward(self, mu: ModuleUnit) -> None:
        if mu.units and all(k in self._reduced for k in mu.units):
            return  # its gradients are already on their way: a late hook (e.g. on a persistent submodule's output)
        self.store.ensure_gathered(mu)
        if mu in self._backward_seen or self.order is None or mu not in self.order:
            return
        self._backward_seen.add(mu)
        position = len(self.order) - 1 - self.order[::-1].index(mu)
        for nxt in reversed(self.order[max(0, position - self.prefetch):position]):
            if nxt not in self._backward_seen:
                self.store.prefetch(nxt)

    def prefetch_next_forward(self) -> None:
        """After a step: start gathering the first `prefetch` units of the recorded order, so the next
        forward's first gathers overlap with what runs before it (a unit then not used is released
        with the others when that forward ends)."""
        for mu in (self.order or [])[:self.prefetch]:
            self.store.prefetch(mu)

    def begin_backward(self) -> None:
        self._backward_seen = set()

    def unit_reduced(self, k: int) -> None:
        """The reducer launched unit k's gradients: free its module unit once all its units have gone."""
        mu = self.store.plan.owner[k]
        if mu.kind in AROUND_USE and mu not in self.whole_pass and all(j in self._reduced for j in mu.units if j != k):
            self.store.release_if_held(mu)  # released already when unused in this pass (its zeros are reduced)
        self._reduced.add(k)

    def end_backward(self) -> None:
        self._reduced.clear()
        for mu in self.store.module_units:
            if mu.kind is not UnitKind.PERSISTENT:
                self.store.release_if_held(mu)
        self.store.drop_idle_blocks()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def kept_whole_message(names: list[str]) -> str:
    return (f"zerorun: stage 3: {', '.join(names)} stay{'s' if len(names) == 1 else ''} gathered for the whole pass, "
            f"as the root unit: the first forward used {'its' if len(names) == 1 else 'their'} parameters outside "
            f"{'its' if len(names) == 1 else 'their'} own forward (e.g. by indexing a weight), where a released "
            "parameter would be read. Call the module instead to have it gathered around its use.")


class _UseWatch(TorchFunctionMode):
    """Notes split units (`owner`: parameter id -> unit) whose parameters a torch function receives while
    their own forward is not running and no scheduler hook is (`outside` gets them)."""

    def __init__(self, scheduler: ParamScheduler, owner: dict[int, ModuleUnit], outside: set[ModuleUnit]) -> None:
        super().__init__()
        self.scheduler, self.owner, self.outside = scheduler, owner, outside

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self.scheduler._own_work:
            for leaf in tree_leaves((args, kwargs or {})):
                mu = self.owner.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if mu is not None and mu not in self.scheduler._inside:
                    self.outside.add(mu)
        return func(*args, **(kwargs or {}))


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
