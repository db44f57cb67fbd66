"""Stage 3's plan: which modules become units, built once before any memory is allocated.

The model is cut into *module units*, each gathered and released as a whole:

| `UnitKind`   | parameters                                                         | gathered                       |
|--------------|--------------------------------------------------------------------|--------------------------------|
| `WRAPPED`    | one module of a `zero.wrap` class (with an empty list: a layer)    | around its forward, backward   |
| `SPLIT`      | outside them, a module of half a bucket or more (an embedding, a head) | around its use, once the first pass allows |
| `ROOT`       | the rest, and parameters shared between units (a tied embedding)   | for all of forward and backward |
| `PERSISTENT` | parameters under `zero.param_persistence_threshold` elements       | always                         |

A split module is gathered for the whole pass, like the root, until the first forward has run
under a watch (`ParamScheduler`): a parameter of it used outside its own forward (`self.pos.weight[:t]`
in the model's forward, a weight tied by hand through a function) keeps it gathered for the whole
pass from then on, so that use never meets a released parameter. The plan's layout never changes:
what the first pass learns is each group's runtime state (`UnitGroup.whole_pass`), as its gathered
state is.

Each module unit is a `UnitGroup` (unit_group.py), which owns its state and its transitions, and
holds one or more `Unit`s (units.py) per param group, of at most `zero.allgather_bucket_mb`: each
is one all-gather and one reduce-scatter.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from zerorun.errors import ZerorunError, ZerorunWarning
from zerorun.runtime import compiled
from zerorun.runtime.ownership import Balance
from zerorun.runtime.stage3.unit_group import AROUND_USE, UnitGroup, UnitKind
from zerorun.runtime.units import Unit, cut_units, group_numels, own_buffer_shapes

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass
class Stage3Plan:
    """The module units and their flat units, before any memory is allocated. Built once: what the first
    pass learns is the scheduler's (param_scheduler.py), and each group's state is its own."""

    groups: list[UnitGroup]  # wrapped and split ones in model order, then the root, then the persistent one
    units: list[Unit]  # in optimizer-state order (reverse module order: backward's)
    group_of: list[UnitGroup]  # per unit (by its slot in `units`), the group it belongs to
    group_numels: list[int]  # this rank's state elements per param group
    root: UnitGroup
    persistent: UnitGroup

    def gathered_units(self) -> list[UnitGroup]:
        """Groups that are gathered and released around their use (wrapped and split ones)."""
        return [g for g in self.groups if g.kind in AROUND_USE and g.units]


def plan_stage3(model: nn.Module, groups: list[list[nn.Parameter]], wrap: list[str], threshold: int,
                auto_numel: int, chunk_numel: int, world: int, dtype: torch.dtype,
                whole: list[Balance | None] | None = None) -> Stage3Plan:
    """Module units for `model` (see the module docstring) and their units of at most `chunk_numel`; `whole`: per
    param group, the owner way's balance (each unit's pieces hold whole parameters), or None."""
    wrapped = wrapped_modules(model, wrap, auto_numel)
    split = split_modules(model, [mod for _, mod in wrapped], max(1, auto_numel // 2))
    position = {mod: i for i, (_, mod) in enumerate(model.named_modules())}
    ordered = sorted([UnitGroup(name, mod, UnitKind.WRAPPED) for name, mod in wrapped]
                     + [UnitGroup(name, mod, UnitKind.SPLIT) for name, mod in split],
                     key=lambda unit_group: position[unit_group.module])
    root = UnitGroup("<root>", model, UnitKind.ROOT)
    persistent = UnitGroup("<persistent>", model, UnitKind.PERSISTENT)
    owner_of = _owners(model, groups, ordered, root, persistent, threshold)
    placing = list(reversed([*ordered, root, persistent]))  # bounded buffers stay reusable by the host allocator
    # the owner way's units: a chunk per rank, as even as whole parameters cut, so that their gathers move about as
    # much in each direction of a link; placed over the whole model at once (ownership.place_units)
    for g, balance in enumerate(whole or []):
        if balance is not None:
            balance.plan([shapes for owner in placing for shapes in own_buffer_shapes(
                [p for p in groups[g] if owner_of.get(p) is owner], chunk_numel * world)])
    units: list[Unit] = []
    group_of: list[UnitGroup] = []
    offsets = [0] * len(groups)
    for owner in placing:
        for g, params in enumerate(groups):  # g: the optimizer's param group
            balance = whole[g] if whole else None
            for unit in cut_units(g, [p for p in params if owner_of.get(p) is owner],
                                  chunk_numel * (world if balance else 1), world, dtype, offsets[g], whole=balance):
                owner.add(len(units), unit)
                units.append(unit)
                group_of.append(owner)
                offsets[g] += unit.shard_numel
    return Stage3Plan([*ordered, root, persistent], units, group_of, group_numels(units, len(groups)), root,
                      persistent)


def _owners(model: nn.Module, groups: list[list[nn.Parameter]], wrapped: list[UnitGroup], root: UnitGroup,
            persistent: UnitGroup, threshold: int) -> dict[nn.Parameter, UnitGroup]:
    """The module unit of every trainable parameter (frozen ones stay whole, outside every unit)."""
    unit_of_module: dict[nn.Module, UnitGroup] = {}
    for group in wrapped:
        for sub in group.module.modules():
            unit_of_module.setdefault(sub, group)
    users: dict[nn.Parameter, set[UnitGroup]] = {}
    for mod in model.modules():
        for param in mod._parameters.values():
            if param is not None:
                users.setdefault(param, set()).add(unit_of_module.get(mod, root))
    trainable = {p for g in groups for p in g}
    out: dict[nn.Parameter, UnitGroup] = {}
    for param, owners in users.items():
        if param not in trainable:
            continue
        if param.numel() < threshold:
            out[param] = persistent
        else:  # shared between units: gathered for the whole pass
            out[param] = next(iter(owners)) if len(owners) == 1 else root
    return out


def wrapped_modules(model: nn.Module, wrap: list[str], auto_numel: int) -> list[tuple[str, nn.Module]]:
    """Modules that become units: those of the classes in `wrap`; with no names, the model's layers
    (each child of a ModuleList, Sequential or ModuleDict, the model itself included, found also inside
    a child that holds them, such as an nn.TransformerEncoder) and any other child with at least
    `auto_numel` parameters. Outermost matches only: a unit never nests in another."""
    if wrap:
        check_wrap_names(model, wrap)
        # a module compiled as `torch.compile(block)` becomes a unit as its wrapper, whose hooks run outside the graph
        wrapper_of = {compiled.unwrapped(mod): (name, mod) for name, mod in model.named_modules()
                      if compiled.unwrapped(mod) is not mod and mod is not model}
        found, inside = [], set[str]()
        for name, mod in model.named_modules():
            if type(mod).__name__ in wrap and mod is not compiled.unwrapped(model) \
                    and not any(name.startswith(p + ".") for p in inside):
                name, mod = wrapper_of.get(mod, (name, mod))
                found.append((name, mod))
                inside.add(name)
        return found

    def visit(prefix: str, module: nn.Module, layers: bool) -> list[tuple[str, nn.Module]]:
        out = []
        for name, child in module.named_children():
            size = sum(p.numel() for p in child.parameters())
            if isinstance(child, CONTAINERS):
                out += visit(f"{prefix}{name}.", child, layers=True)
            elif size and not layers and holds_repeated_layers(child):  # nn.TransformerEncoder, a HF backbone
                out += visit(f"{prefix}{name}.", child, layers=False)
            elif size and (layers or size >= auto_numel):
                out.append((f"{prefix}{name}", child))
        return out

    inner = compiled.unwrapped(model)  # torch.compile(model): plan the model it holds, as if it were not compiled
    prefix = "" if inner is model else f"{_name_of(model, inner)}."
    return visit(prefix, inner, layers=isinstance(inner, CONTAINERS))


def _name_of(model: nn.Module, sub: nn.Module) -> str:
    return next(str(name) for name, mod in model.named_modules() if mod is sub)


def holds_repeated_layers(module: nn.Module) -> bool:
    """Whether a container somewhere inside `module` holds two or more modules of one class (its layers):
    then those layers are the units, not `module` whole."""
    for sub in module.modules():
        if sub is not module and isinstance(sub, CONTAINERS):
            classes = [type(layer) for layer in sub.children()]
            if len(classes) > len(set(classes)):
                return True
    return False


def split_modules(model: nn.Module, wrapped: list[nn.Module], min_numel: int) -> list[tuple[str, nn.Module]]:
    """Modules outside every wrapped one, holding none, with at least `min_numel` parameters (outermost
    only, never a container, which has no forward to hook): split off the root unit (an embedding, an
    output head), so that they are not gathered for the whole pass."""
    units = set(wrapped)
    inside = {sub for mod in wrapped for sub in mod.modules()}
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if child in inside:
                continue
            if isinstance(child, CONTAINERS) or any(sub in units for sub in child.modules()):
                visit(f"{prefix}{name}.", child)
            elif sum(p.numel() for p in child.parameters()) >= min_numel:
                found.append((f"{prefix}{name}", child))

    inner = compiled.unwrapped(model)
    visit("" if inner is model else f"{_name_of(model, inner)}.", inner)
    return found


def check_wrap_names(model: nn.Module, wrap: list[str]) -> None:
    """Every `zero.wrap` name must be the class of a module inside `model` (a typo would shard nothing)."""
    classes = sorted({type(mod).__name__ for mod in model.modules() if mod is not compiled.unwrapped(model)})
    unknown = [name for name in wrap if name not in classes]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, classes, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    model_class = type(compiled.unwrapped(model)).__name__
    itself = " (the model itself is always the root unit)" if model_class in unknown else ""
    raise ZerorunError(f"zero.wrap: no module of class {', '.join(hints)} in {model_class}{itself}; "
                       f"its module classes are {', '.join(classes)}. List the classes of its repeated layers "
                       "(e.g. [Block]), or [] to pick its layers automatically.")


def describe(plan: Stage3Plan) -> str:
    """One line: how stage 3 cut the model (what `zerorun.initialize` prints on rank 0)."""
    gathered = [g for g in plan.gathered_units() if g.kind is UnitKind.WRAPPED]
    split = [g for g in plan.gathered_units() if g.kind is UnitKind.SPLIT]
    classes = sorted({type(compiled.unwrapped(g.module)).__name__ for g in gathered})
    sharded = sum(g.numel for g in gathered)
    apart = (f", {len(split)} split off the root ({', '.join(compiled.model_name(g.name) for g in split)}; "
             f"{sum(g.numel for g in split):,} parameters)" if split else "")
    return (f"zerorun: stage 3: {len(gathered)} units ({', '.join(classes) or 'none'}; {sharded:,} parameters "
            f"gathered around their use){apart}, {plan.root.numel:,} in the root unit, "
            f"{plan.persistent.numel:,} persistent")


def warn_if_nothing_sharded(plan: Stage3Plan, wrap: list[str], threshold: int) -> None:
    """Stage 3 with no unit gathers everything for the whole forward and backward: say so (call on one rank)."""
    if plan.gathered_units():
        return
    total = sum(u.layout.numel for u in plan.units)
    in_root, persistent = plan.root.numel, plan.persistent.numel
    warnings.warn(
        f"zerorun stage 3 made no units: of {total:,} trainable parameters, {in_root:,} are in the root unit "
        f"(gathered for all of forward and backward) and {persistent:,} are persistent (fewer than "
        f"zero.param_persistence_threshold={threshold:,} elements each), so every rank holds all of them through "
        f"forward and backward and stage 3 saves no memory over stage 2. Set zero.wrap to the class of the "
        f"model's repeated layers (it is {wrap or '[]'} now) or lower zero.param_persistence_threshold.",
        ZerorunWarning, stacklevel=5)  # the script's zerorun.initialize(...): via Engine.__init__, _build_stage
