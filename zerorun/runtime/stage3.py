"""ZeRO stage 3: parameters live only as this rank's fp32 shard and are gathered around their use.

The model is cut into *module units*: each module whose class is in `zero.wrap` (or, with an
empty list, large children found automatically), a root unit for the remaining parameters and
for parameters shared between units (tied embeddings), and a persistent unit for parameters under
`zero.param_persistence_threshold` elements, which stay gathered. Each module unit holds one
`Unit` (a sharded `FlatLayout`) per optimizer param group, like stages 1/2.

A unit's gathered buffer is a tensor whose storage is resized to zero when released and back
when gathered, so the module's parameters (views into it) and tensors autograd saved during
forward stay valid across release and re-gather. A unit's state machine:

    released --gather()--> gathering --wait()--> gathered --release()--> released

`ParamScheduler` decides when: before a unit's forward (prefetching the next `prefetch_units`
in the execution order recorded on the first pass), after its forward (release, unless backward
is running: activation-checkpoint recomputation), before its backward (a hook on its outputs,
prefetching in reverse order), and once its gradients are reduced (the reducer's `on_launch`).
Gradients take the stage 2 path: fp32 staging per unit, reduce-scatter into the rank's shard.
"""

from __future__ import annotations

import difflib
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zerorun.errors import ZerorunError, ZerorunWarning
from zerorun.runtime.collectives import Collectives, Handle
from zerorun.runtime.flat import ALIGN_BYTES, Unit
from zerorun.runtime.memory import retain_freed_host_memory
from zerorun.runtime.partition import bucket_params, flat_layout
from zerorun.runtime.precision import PrecisionPolicy
from zerorun.runtime.sharded_init import InitLog, materialize


@dataclass
class ModuleUnit:
    """Parameters gathered and released together (one wrapped module, the root, or the persistent set)."""

    name: str
    module: nn.Module
    kind: str  # "wrap" | "root" | "persistent"
    units: list[int] = field(default_factory=list)  # indices into ShardedParams.units
    state: str = "released"
    handles: list[Handle] = field(default_factory=list)


class ShardedParams:
    """Stage 3 parameter store: fp32 master pieces per group, gathered unit buffers on demand.

    Offers the interface `GradReducer` and the optimizer use (`units`, `group_numels`,
    `state_slice`, `master_pieces`, `publish`), so stage 3 reuses both unchanged.
    """

    shard_world: int

    def __init__(self, model: nn.Module, groups: list[list[nn.Parameter]], wrap: list[str],
                 persistence_threshold: int, bucket_numel: int, policy: PrecisionPolicy,
                 comm: Collectives, device: torch.device, init_log: InitLog | None = None,
                 master_device: torch.device | None = None) -> None:
        self.policy, self.comm, self.device = policy, comm, device
        self.master_device = master_device or device  # the host when the optimizer is offloaded
        self.param_shard: list[torch.Tensor] | None = None  # see use_param_shard
        self.param_store = None  # see use_param_store
        self.master_home = None  # optimizer offload to NVMe: the master lives there (self.master is None)
        if device.type == "cpu":
            retain_freed_host_memory()
        self.shard_world, self.shard_rank = comm.world_size, comm.rank
        self.module_units = self._plan_module_units(model, groups, wrap, persistence_threshold, bucket_numel)
        self.units: list[Unit] = []
        self.full: list[torch.Tensor] = []  # per unit: the gathered buffer (storage resized to 0 when released)
        self.views: list[list[torch.Tensor]] = []  # per unit: its parameters' views into `full`
        self.peak_gathered_bytes = 0
        self.unit_owner: list[ModuleUnit] = []
        self._layout_units(groups, bucket_numel)
        self.group_numels = [sum(u.layout.shard_numel for u in self.units if u.group == g) for g in range(len(groups))]
        self.master = self._shard_from_replay(init_log) if init_log is not None else self._shard_from(model)
        self._make_views()
        for mu in self.module_units:
            self.release(mu) if mu.kind != "persistent" else self.gather(mu)
        self.wait(self.persistent)

    # -- planning ---------------------------------------------------------------------------
    def _plan_module_units(self, model: nn.Module, groups: list[list[nn.Parameter]], wrap: list[str],
                           threshold: int, auto_numel: int) -> list[ModuleUnit]:
        wrapped = wrapped_modules(model, wrap, auto_numel)
        root = ModuleUnit("<root>", model, "root")
        self.persistent = ModuleUnit("<persistent>", model, "persistent")
        unit_of_module: dict[nn.Module, ModuleUnit] = {}
        ordered = [ModuleUnit(name, mod, "wrap") for name, mod in wrapped]
        for mu in ordered:
            for sub in mu.module.modules():
                unit_of_module.setdefault(sub, mu)
        users: dict[nn.Parameter, set[int]] = {}
        for mod in model.modules():
            for param in mod._parameters.values():
                if param is not None:
                    users.setdefault(param, set()).add(id(unit_of_module.get(mod, root)))
        by_id = {id(mu): mu for mu in [*ordered, root]}
        trainable = {p for g in groups for p in g}
        self.param_unit: dict[nn.Parameter, ModuleUnit] = {}
        for param, owners in users.items():
            if param not in trainable:
                continue  # frozen parameters stay whole (not sharded)
            if param.numel() < threshold:
                self.param_unit[param] = self.persistent
            elif len(owners) == 1:
                self.param_unit[param] = by_id[next(iter(owners))]
            else:
                self.param_unit[param] = root  # shared between units: gathered for the whole pass
        return [*ordered, root, self.persistent]

    def _layout_units(self, groups: list[list[nn.Parameter]], bucket_numel: int) -> None:
        """Units per (module unit, param group), each at most a bucket (or one larger parameter), in
        reverse module order (backward's order). Bounded buffers stay reusable by the host allocator."""
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=self.policy.param_dtype).element_size())
        state_offsets = [0] * len(groups)
        for mu in reversed(self.module_units):
            for g, params in enumerate(groups):
                members = [p for p in params if self.param_unit.get(p) is mu]
                for indices in bucket_params([p.numel() for p in members], bucket_numel) if members else []:
                    chunk = [members[i] for i in indices]
                    layout = flat_layout([p.numel() for p in chunk], self.shard_world, align)
                    mu.units.append(len(self.units))
                    self.units.append(Unit(g, chunk, layout, 0, state_offsets[g]))
                    self.unit_owner.append(mu)
                    state_offsets[g] += layout.shard_numel
                    self.full.append(torch.empty(layout.padded_numel, dtype=self.policy.param_dtype,
                                                 device=self.device))

    def _shard_from(self, model: nn.Module) -> list[torch.Tensor]:
        """Keep this rank's pieces of rank 0's parameter values as fp32 master, one unit at a time."""
        master = [torch.zeros(n, dtype=torch.float32, device=self.master_device) for n in self.group_numels]
        for unit in self.units:
            full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=self.device)
            for span, param in zip(unit.layout.spans, unit.params):
                full[span.offset:span.end].copy_(param.detach().reshape(-1))
            self.comm.broadcast(full, src=0).wait()
            self.state_slice(unit, master[unit.group]).copy_(self.unit_piece(unit, full))
        return master

    def _shard_from_replay(self, log: InitLog) -> list[torch.Tensor]:
        """Replay a `sharded_init` log, keeping only this rank's pieces (every rank computes the same values)."""
        master = [torch.zeros(n, dtype=torch.float32, device=self.master_device) for n in self.group_numels]
        place = {param: (unit, span) for unit in self.units for span, param in zip(unit.layout.spans, unit.params)}

        def keep(param: nn.Parameter, value: torch.Tensor) -> None:
            if param not in place:  # frozen: stays whole
                materialize(param, value)
                return
            unit, span = place[param]
            lo, hi = unit.layout.shard_range(self.shard_rank)
            start, end = max(span.offset, lo), min(span.end, hi)
            if start < end:
                piece = self.state_slice(unit, master[unit.group])[start - lo:end - lo]
                piece.copy_(value.reshape(-1)[start - span.offset:end - span.offset])

        log.replay(keep, self.device)
        return master

    def _make_views(self) -> None:
        """Parameters become views into their unit's buffer (kept here while the unit is released)."""
        for k, unit in enumerate(self.units):
            self.views.append([self.full[k][span.offset:span.end].view(param.shape)
                               for span, param in zip(unit.layout.spans, unit.params)])
            for param in unit.params:
                if param.is_meta:  # from sharded_init: becomes a real (empty until gathered) parameter
                    materialize(param, torch.empty(0, dtype=self.policy.param_dtype, device=self.device))

    # -- views (the interface shared with FlatParams) ------------------------------------------
    def unit_piece(self, unit: Unit, buffer: torch.Tensor) -> torch.Tensor:
        start, end = unit.layout.shard_range(self.shard_rank)
        return buffer[start:end]

    @staticmethod
    def state_slice(unit: Unit, group_state: torch.Tensor) -> torch.Tensor:
        return group_state[unit.state_offset:unit.state_offset + unit.layout.shard_numel]

    def master_pieces(self, group: int) -> list[torch.Tensor]:
        return [self.state_slice(u, self.master[group]) for u in self.units if u.group == group]

    def use_param_shard(self, place: torch.device, pin: bool = False) -> list[torch.Tensor]:
        """Keep this rank's parameter shard in the compute dtype at `place`, and gather from it.

        Used when the optimizer is offloaded: the fp32 master then lives on the host (or NVMe) and
        is touched only by the optimizer, which writes each update into this shard in the same pass;
        `place` is the device, or the host for `offload_param: cpu` (pinned where CUDA exists)."""
        pin = pin and place.type == "cpu" and torch.cuda.is_available()
        self.param_shard = [torch.empty(n, dtype=self.policy.param_dtype, device=place, pin_memory=pin)
                            for n in self.group_numels]
        for shard, master in zip(self.param_shard, self.master):
            shard.copy_(master)
        return self.param_shard

    def use_param_store(self, store, pin: bool = False) -> None:
        """Keep this rank's compute-dtype parameter shard in NVMe files instead (`offload_param: nvme`):
        one file per param group in `store` (an `NvmeStore`); gathers read their piece through an
        aligned bounce buffer the size of the largest piece."""
        from zerorun.runtime.nvme import aligned_empty

        dtype = self.policy.param_dtype
        for g, master in enumerate(self.master):
            for lo in range(0, master.numel(), 2**24):  # bounded host memory while placing
                store.write(self.param_file(g), master[lo:lo + 2**24].to(dtype), start=lo)
        self.param_store = store
        self._bounce = aligned_empty(max((u.layout.shard_numel for u in self.units), default=0), dtype, pin)

    def bounce_bytes(self) -> int:
        """Host bytes of the bounce buffer gathers read NVMe-resident pieces through."""
        return self._bounce.numel() * self._bounce.element_size() if self.param_store is not None else 0

    @staticmethod
    def param_file(group: int) -> str:
        return f"params-{group}"

    def shard_pieces(self, group: int) -> list[torch.Tensor | None]:
        """Where gathers read `group`'s pieces from (and an offloaded optimizer writes them); None
        for pieces in NVMe files (`write_param_piece`)."""
        units = [u for u in self.units if u.group == group]
        if self.param_store is not None:
            return [None for _ in units]
        source = self.param_shard if self.param_shard is not None else self.master
        return [self.state_slice(u, source[group]) for u in units]

    def write_param_piece(self, group: int, start: int, values: torch.Tensor) -> None:
        """Write compute-dtype values at `start` of `group`'s shard file (`offload_param: nvme`)."""
        self.param_store.write(self.param_file(group), values, start=start)

    def _fill_piece(self, unit: Unit, full: torch.Tensor) -> None:
        """Copy this rank's piece of `unit` into its gathered buffer (casting, or host->device)."""
        piece = self.unit_piece(unit, full)
        if self.param_store is not None:
            bounce = self._bounce[:piece.numel()]
            self.param_store.read(self.param_file(unit.group), bounce, start=unit.state_offset)
            piece.copy_(bounce)  # synchronous: the bounce buffer is reused by the next piece
            return
        source = self.param_shard if self.param_shard is not None else self.master
        piece.copy_(self.state_slice(unit, source[unit.group]), non_blocking=True)

    def read_master_piece(self, unit: Unit, out: torch.Tensor) -> None:
        """This rank's fp32 master piece of `unit`, into `out` (from memory or the NVMe home)."""
        if self.master is None:
            values = torch.empty(unit.layout.shard_numel, dtype=torch.float32)
            self.master_home.read(unit.group, "master", values, start=unit.state_offset)
            out.copy_(values)
        else:
            out.copy_(self.state_slice(unit, self.master[unit.group]))

    def set_master_piece(self, unit: Unit, values: torch.Tensor) -> None:
        """Overwrite this rank's piece of `unit` (fp32 master, and the compute-dtype shard if kept)."""
        if self.master is None:
            self.master_home.write(unit.group, "master", values.float().cpu(), start=unit.state_offset)
        else:
            self.state_slice(unit, self.master[unit.group]).copy_(values)
        if self.param_store is not None:
            self.write_param_piece(unit.group, unit.state_offset, values.to(self.policy.param_dtype).cpu())
        elif self.param_shard is not None:
            self.state_slice(unit, self.param_shard[unit.group]).copy_(values)

    # -- the state machine --------------------------------------------------------------------
    def gather(self, mu: ModuleUnit) -> None:
        """Start gathering `mu` (no-op unless released); `wait` finishes it."""
        if mu.state != "released":
            return
        for k in mu.units:
            unit, full = self.units[k], self.full[k]
            full.untyped_storage().resize_(full.numel() * full.element_size())
            self._fill_piece(unit, full)
            mu.handles.append(self.comm.all_gather(full))
            for param, view in zip(unit.params, self.views[k]):
                param.data = view
        mu.state = "gathering"
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def wait(self, mu: ModuleUnit) -> None:
        if mu.state == "released":
            self.gather(mu)
        for handle in mu.handles:
            handle.wait()
        mu.handles.clear()
        mu.state = "gathered"

    def release(self, mu: ModuleUnit) -> None:
        if mu.state == "gathering":
            self.wait(mu)  # never free a buffer a collective is writing into
        for k in mu.units:
            self.full[k].untyped_storage().resize_(0)
            # a stray read of a released parameter is then an empty tensor, not freed memory; tensors
            # autograd saved keep the resizable storage and see the data again once re-gathered
            for param in self.units[k].params:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        mu.state = "released"

    def publish(self, cast_done: bool = False) -> None:
        """After an optimizer step: refresh every unit that is gathered right now (the rest gather later).

        `cast_done` is part of the shared interface; stage 3 always refills from the master."""
        live = [mu for mu in self.module_units if mu.state != "released"]
        for mu in live:
            self.release(mu)
            self.gather(mu)
        for mu in live:
            self.wait(mu)

    def unit_count(self) -> int:
        """Module units that are gathered and released around their use (not the root or persistent set)."""
        return sum(1 for mu in self.module_units if mu.kind == "wrap" and mu.units)

    def gathered_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.full)

    def numel(self) -> int:
        return sum(u.layout.numel for u in self.units)


CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def wrapped_modules(model: nn.Module, wrap: list[str], auto_numel: int) -> list[tuple[str, nn.Module]]:
    """Modules that become units: those of the classes in `wrap`; with no names, the model's layers
    (each child of a ModuleList, Sequential or ModuleDict, the model itself included) and any other
    child with at least `auto_numel` parameters. Outermost matches only: a unit never nests in another."""
    if wrap:
        check_wrap_names(model, wrap)
        found, inside = [], set()
        for name, mod in model.named_modules():
            if type(mod).__name__ in wrap and mod is not model and not any(name.startswith(p + ".") for p in inside):
                found.append((name, mod))
                inside.add(name)
        return found

    def visit(prefix: str, module: nn.Module, layers: bool) -> list[tuple[str, nn.Module]]:
        out = []
        for name, child in module.named_children():
            size = sum(p.numel() for p in child.parameters())
            if isinstance(child, CONTAINERS):
                out += visit(f"{prefix}{name}.", child, layers=True)
            elif size and (layers or size >= auto_numel):
                out.append((f"{prefix}{name}", child))
        return out

    return visit("", model, layers=isinstance(model, CONTAINERS))


def check_wrap_names(model: nn.Module, wrap: list[str]) -> None:
    """Every `zero.wrap` name must be the class of a module inside `model` (a typo would shard nothing)."""
    classes = sorted({type(mod).__name__ for mod in model.modules() if mod is not model})
    unknown = [name for name in wrap if name not in classes]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, classes, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    itself = " (the model itself is always the root unit)" if type(model).__name__ in unknown else ""
    raise ZerorunError(f"zero.wrap: no module of class {', '.join(hints)} in {type(model).__name__}{itself}; "
                       f"its module classes are {', '.join(classes)}. List the classes of its repeated layers "
                       "(e.g. [Block]), or [] to pick its layers automatically.")


def warn_if_nothing_sharded(store: ShardedParams, wrap: list[str], threshold: int) -> None:
    """Stage 3 with no unit gathers everything for the whole forward and backward: say so, once, on rank 0."""
    if store.unit_count() or store.shard_rank != 0:
        return
    count = lambda mu: sum(store.units[k].layout.numel for k in mu.units)  # noqa: E731
    root = next(mu for mu in store.module_units if mu.kind == "root")
    total, in_root, persistent = sum(u.layout.numel for u in store.units), count(root), count(store.persistent)
    warnings.warn(
        f"zerorun stage 3 made no units: of {total:,} trainable parameters, {in_root:,} are in the root unit "
        f"(gathered for all of forward and backward) and {persistent:,} are persistent (fewer than "
        f"zero.param_persistence_threshold={threshold:,} elements each), so every rank holds all of them through "
        f"forward and backward and stage 3 saves no memory over stage 2. Set zero.wrap to the class of the "
        f"model's repeated layers (it is {wrap or '[]'} now) or lower zero.param_persistence_threshold.",
        ZerorunWarning, stacklevel=4)  # points at the script's zerorun.initialize(...)


class ParamScheduler:
    """Module hooks that gather, prefetch and release units around forward and backward."""

    def __init__(self, store: ShardedParams, prefetch: int) -> None:
        self.store = store
        self.prefetch = prefetch
        self.in_backward = False
        self.order: list[ModuleUnit] | None = None  # forward execution order, recorded on the first pass
        self._observed: list[ModuleUnit] = []
        self._backward_seen: set[int] = set()
        self._reduced: set[int] = set()
        self._hooks: list[RemovableHandle] = []
        wrapped = [mu for mu in store.module_units if mu.kind == "wrap" and mu.units]
        root = next(mu for mu in store.module_units if mu.kind == "root")
        for mu in wrapped:
            self._hooks.append(mu.module.register_forward_pre_hook(lambda m, a, mu=mu: self._before_forward(mu)))
            self._hooks.append(mu.module.register_forward_hook(lambda m, a, out, mu=mu: self._after_forward(mu, out)))
        for mu in wrapped:  # submodules called on their own, outside their unit's forward
            for sub in mu.module.modules():
                if sub is not mu.module and any(store.param_unit.get(p) is mu for p in sub._parameters.values()):
                    self._hooks.append(sub.register_forward_pre_hook(lambda m, a, mu=mu: self._ensure(mu)))
                    self._hooks.append(sub.register_forward_hook(lambda m, a, out, mu=mu: self._guard_backward(mu, out)))
        self.root = root
        self._hooks.append(root.module.register_forward_pre_hook(lambda m, a: self._root_before()))
        self._hooks.append(root.module.register_forward_hook(lambda m, a, out: self._root_after(out)))

    # -- forward --------------------------------------------------------------------------------
    def _root_before(self) -> None:
        if not self.in_backward:
            self._observed = []
        self._ensure(self.root)

    def _root_after(self, out: object) -> None:
        if self.in_backward:
            return
        if self._observed and self._observed != self.order:
            self.order = list(self._observed)  # first pass, or the execution order changed: re-record
        self._guard_backward(self.root, out)
        keep_root = torch.is_grad_enabled()  # backward will need the root (and shared) parameters
        for mu in self.store.module_units:
            if mu.kind == "wrap" or (mu.kind == "root" and not keep_root):
                self.store.release(mu)

    def _before_forward(self, mu: ModuleUnit) -> None:
        if not self.in_backward:
            self._observed.append(mu)
        self._ensure(mu)
        if not self.in_backward and self.order is not None:
            position = len(self._observed) - 1
            if position < len(self.order) and self.order[position] is mu:
                for nxt in self.order[position + 1:position + 1 + self.prefetch]:
                    self.store.gather(nxt)

    def _after_forward(self, mu: ModuleUnit, out: object) -> None:
        self._guard_backward(mu, out)
        if not self.in_backward:  # during backward this is checkpoint recomputation: backward needs them
            self.store.release(mu)

    def _ensure(self, mu: ModuleUnit) -> None:
        self.store.wait(mu)

    # -- backward -------------------------------------------------------------------------------
    def _guard_backward(self, mu: ModuleUnit, out: object) -> None:
        """Gather `mu` again when gradients reach its outputs, before its backward runs."""
        if not torch.is_grad_enabled():
            return
        for tensor in _tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, mu=mu: self._before_backward(mu))

    def _before_backward(self, mu: ModuleUnit) -> None:
        if mu.units and all(k in self._reduced for k in mu.units):
            return  # its gradients are already on their way: a late hook (e.g. on a persistent submodule's output)
        self._ensure(mu)
        if id(mu) in self._backward_seen or self.order is None or mu not in self.order:
            return
        self._backward_seen.add(id(mu))
        position = len(self.order) - 1 - self.order[::-1].index(mu)
        for nxt in reversed(self.order[max(0, position - self.prefetch):position]):
            if id(nxt) not in self._backward_seen:
                self.store.gather(nxt)

    def begin_backward(self) -> None:
        self.in_backward = True
        self._backward_seen = set()

    def unit_reduced(self, k: int) -> None:
        """The reducer launched unit k's gradients: free its module unit once all its units have gone."""
        mu = self.store.unit_owner[k]
        if mu.kind == "wrap" and all(j in self._reduced for j in mu.units if j != k):
            self.store.release(mu)
        self._reduced.add(k)

    def end_backward(self) -> None:
        self.in_backward = False
        self._reduced.clear()
        for mu in self.store.module_units:
            if mu.kind != "persistent":
                self.store.release(mu)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@contextmanager
def gathered(store: ShardedParams, params: Iterable[nn.Parameter] | None = None, modify: bool = False,
             src: int = 0) -> Iterator[None]:
    """Full parameters inside the block; with `modify`, rank `src`'s values are written back to every shard."""
    wanted = set(params) if params is not None else None
    units = [mu for mu in store.module_units
             if wanted is None or any(store.units[k].params[i] in wanted
                                      for k in mu.units for i in range(len(store.units[k].params)))]
    before = {id(mu): mu.state for mu in units}
    for mu in units:
        store.gather(mu)
    for mu in units:
        store.wait(mu)
    try:
        yield
    finally:
        for mu in units:
            for k in mu.units:
                if modify:
                    unit, full = store.units[k], store.full[k]
                    store.comm.broadcast(full, src=src).wait()
                    store.set_master_piece(unit, store.unit_piece(unit, full))
            if before[id(mu)] == "released":
                store.release(mu)


def full_state_dict(module: nn.Module, store: ShardedParams) -> dict[str, torch.Tensor]:
    """The consolidated fp32 state dict on rank 0 ({} elsewhere), gathering one unit's master at a time."""
    names: dict[nn.Parameter, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(param, []).append(name)
    values: dict[str, torch.Tensor] = {}
    for k, unit in enumerate(store.units):
        full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=store.device)
        store.read_master_piece(unit, store.unit_piece(unit, full))
        store.comm.all_gather(full).wait()
        if store.shard_rank == 0:
            for span, param, view in zip(unit.layout.spans, unit.params, store.views[k]):
                for name in names[param]:
                    values[name] = full[span.offset:span.end].view(view.shape).cpu().clone()
    if store.shard_rank != 0:
        return {}
    return {key: values[key] if key in values else value.detach().cpu().clone()
            for key, value in module.state_dict(keep_vars=True).items()}


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
