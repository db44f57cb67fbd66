"""Taking over the script's optimizers: their param groups, the way each runs, and the state they hold.

`zerorun.initialize(model, optimizer)` takes one torch optimizer or a list of them over disjoint
parameters (Muon for the hidden matrices and AdamW for the rest, as torch's documentation
recommends). Every param group becomes one of the engine's groups, in order, sharing the script's
own group dict (a scheduler on either object, or `group["lr"] = ...`, drives the update) and its
optimizer object, which performs the update (ways.py says how each group runs).

The state an optimizer already holds is taken over too, not dropped: Adagrad makes its `sum` when
it is built, and a script that loaded a checkpoint into its optimizer before handing it over
continues from it. The flat ways lay the state's per-element kinds out like the master (update.py
writes them into the home); the owner way keeps each parameter's state with its owner. Either way the
script's optimizer then holds none for the model's parameters (each rank keeps only its share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerorun.errors import ZerorunError
from zerorun.runtime.offload.homes import ADAM_KINDS
from zerorun.runtime.optim.elementwise import State, probe_kinds, split_state
from zerorun.runtime.optim.ways import Way, refuse_unrunnable, way_of, whole_cost
from zerorun.runtime.ownership import Cost


@dataclass(eq=False)
class EngineGroup:
    """One param group of one of the script's optimizers, as the engine runs it."""

    optimizer: torch.optim.Optimizer  # the script's object: it performs the update (but for the fused way)
    index: int  # the group's position in `optimizer.param_groups`
    params: list[nn.Parameter]  # its trainable parameters, in the group's order
    way: Way
    where: str  # "param group 1 of the AdamW" (for messages)
    kinds: tuple[str, ...] = ()  # the flat ways: what the optimizer keeps per element (owner: nothing flat)
    carried: dict[nn.Parameter, State] = field(default_factory=dict)  # the state it held when handed over
    scalars: State | None = None  # the flat ways' one value per group of each other state entry (`step`), carried
    # over; None while the group holds no state (its optimizer has not stepped it)

    @property
    def whole(self) -> Cost | None:
        """The owner way's cost of a whole parameter (the stage lays each out whole in its owner's piece, balanced
        by it); None for the flat ways."""
        return whole_cost(self.optimizer) if self.way is Way.OWNER else None

    @property
    def hyper(self) -> dict[str, Any]:
        """The script's own param group dict (hyper-parameters; its `params` are the script's)."""
        return self.optimizer.param_groups[self.index]

    def carried_scalars(self) -> State | None:
        """The scalars of the carried state, one value per group (refused when the parameters' differ)."""
        if not self.carried:
            return None
        splits = [split_state(self.carried[p], p, self.where)[1] for p in self.params]
        first = splits[0]
        for p, other in zip(self.params, splits):
            if not _same(first, other):
                raise ZerorunError(f"{self.where}: its parameters hold different {sorted(first)} (a {p.shape} one "
                                   f"has {other}, another {first}); zerorun runs this group over a flat shard, with one "
                                   "value per group. Hand over an optimizer whose parameters have all stepped alike.")
        return first


def given_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """What a script passed as `optimizer`: None, one optimizer, or a list or tuple of them."""
    given = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for i, opt in enumerate(given):
        if not isinstance(opt, torch.optim.Optimizer):
            where = f"optimizer[{i}]" if isinstance(optimizer, (list, tuple)) else "optimizer"
            raise ZerorunError(f"zerorun.initialize({where}=...): expected a torch.optim.Optimizer (or a list of them), "
                               f"got {type(opt).__name__}.")
        refuse_unrunnable(opt)
    return given


def take_over(optimizers: list[torch.optim.Optimizer], model: nn.Module, device: torch.device) -> list[EngineGroup]:
    """The engine's param groups, from every group of every optimizer (see the module docstring)."""
    groups: list[EngineGroup] = []
    place: dict[nn.Parameter, str] = {}
    for o, opt in enumerate(optimizers):
        for index, hyper in enumerate(opt.param_groups):
            name = type(opt).__name__ + (f" (optimizer {o})" if len(optimizers) > 1 else "")
            where = f"param group {index} of the {name}"
            params = [p for p in hyper["params"] if p.requires_grad]
            for p in params:
                if p in place:
                    raise ZerorunError(f"a parameter {tuple(p.shape)} is in {place[p]} and in {where}: each parameter "
                                       "belongs to one param group of one optimizer.")
                place[p] = where
            groups.append(EngineGroup(opt, index, params, way_of(opt, hyper), where))
    stray = [n for n, p in model.named_parameters() if p.requires_grad and p not in place]
    if stray:
        raise ZerorunError(f"trainable parameters missing from the optimizer's param groups: {', '.join(stray[:5])}"
                           f"{' ...' if len(stray) > 5 else ''}; add them to a group or set requires_grad=False.")
    for group in groups:
        _take_state(group, device)
    return groups


def _take_state(group: EngineGroup, device: torch.device) -> None:
    """Move the state the optimizer holds for the group's parameters into `carried`, and learn the group's kinds."""
    opt = group.optimizer
    group.carried = {p: dict(opt.state.pop(p)) for p in list(group.hyper["params"]) if opt.state.get(p)}
    group.carried = {p: state for p, state in group.carried.items() if p.requires_grad}  # frozen ones: dropped
    if group.carried and len(group.carried) != len(group.params):
        raise ZerorunError(f"{group.where}: {len(group.carried)} of its {len(group.params)} parameters hold optimizer "
                           "state and the others none; hand over an optimizer whose parameters have all stepped alike "
                           "(or none).")
    if group.way is Way.OWNER:
        return
    if group.carried:
        first = group.params[0]
        group.kinds = tuple(split_state(group.carried[first], first, group.where)[0])
        group.scalars = group.carried_scalars()
    elif group.way is Way.ELEMENTWISE:
        group.kinds = probe_kinds(opt, group.index, device, group.where)
    if group.way is Way.FUSED_ADAM:
        if group.carried and set(group.kinds) != set(ADAM_KINDS):
            raise ZerorunError(f"{group.where}: it holds state {sorted(group.kinds)}, not Adam's {list(ADAM_KINDS)}.")
        group.kinds = ADAM_KINDS


def _same(a: State, b: State) -> bool:
    if a.keys() != b.keys():
        return False
    return all(bool(torch.equal(torch.as_tensor(a[k]).cpu(), torch.as_tensor(b[k]).cpu())) if
               isinstance(a[k], (torch.Tensor, int, float)) else a[k] == b[k] for k in a)
