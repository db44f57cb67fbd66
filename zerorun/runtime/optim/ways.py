"""How each param group's optimizer runs over what this rank owns: the way, chosen once per group.

A ZeRO stage gives each rank a flat piece of every parameter group (units.py): pieces of several
parameters back to back, a parameter often cut between two ranks. Which optimizers are right there?

| way           | runs                                                       | right for                      |
|---------------|------------------------------------------------------------|--------------------------------|
| `FUSED_ADAM`  | zerorun's fused Adam(W) kernel over the flat piece (ops.py)  | torch's Adam/AdamW, plain       |
| `ELEMENTWISE` | the script's optimizer over the flat piece, as if it were one parameter (elementwise.py) | updates where each element depends on its own gradient and state alone |
| `OWNER`       | the script's optimizer on whole parameters, each owned by one rank (owner_step.py) | every update of a parameter that depends on that parameter alone |

The flat piece is only right for an elementwise update, and only zerorun's knowledge makes an update
elementwise: torch's own elementwise optimizers, the third-party ones the tests prove, and classes
the script declares (`class MyOpt(zerorun.Elementwise, torch.optim.Optimizer)`). Every other class
takes the owner way, which is right for any optimizer whose update of a parameter needs only that
parameter (Muon's Newton-Schulz, Adafactor's factored moments, LAMB's trust ratio, Shampoo): running
such an optimizer over a flat piece is how DeepSpeed's stage 0 trained Muon as plain SGD, silently.
What no way can run is refused by name (`REFUSED`).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch

from zerorun.errors import ZerorunError
from zerorun.runtime.ownership import Cost, matrix_cost, size_cost


class Way(Enum):
    """How a param group's update runs (see the module docstring)."""

    FUSED_ADAM = "fused-adam"
    ELEMENTWISE = "elementwise"
    OWNER = "owner"


class Elementwise:
    """Declares an optimizer class elementwise (each element's update depends on its own gradient and state only,
    never on a parameter's shape or other elements): zerorun then runs it over each rank's flat shard.

        class MyOpt(zerorun.Elementwise, torch.optim.Optimizer): ...
        class MyLion(zerorun.Elementwise, SomeonesLion): pass     # a class of someone else's

    A state entry that is not elementwise (a tensor of another shape than its parameter) is refused at the first
    step. Without the declaration a class zerorun does not know runs on whole parameters (the owner way)."""


# torch's own optimizers whose updates are elementwise (their state: tensors like the parameter, and scalars)
TORCH_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
                     torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
                     torch.optim.Rprop)
# third-party classes proven elementwise by tests/runtime/test_any_optimizer.py: (module, class name)
KNOWN_ELEMENTWISE = frozenset({("lion_pytorch.lion_pytorch", "Lion")})

REFUSED = (  # (class, why)
    (torch.optim.LBFGS, "LBFGS steps with a closure that re-runs the forward and backward several times per step and "
                        "searches along one direction over the whole model: it cannot run on a sharded model; use "
                        "another optimizer, or train it with plain DDP"),
    (torch.optim.SparseAdam, "SparseAdam updates sparse gradients (nn.Embedding(sparse=True)), and zerorun reduces "
                             "dense gradients: use Adam or AdamW, with a dense embedding"),
)
FUSED_BLOCKERS = ("amsgrad", "maximize", "differentiable", "capturable")  # Adam(W) options the fused kernel lacks


def refuse_unrunnable(optimizer: torch.optim.Optimizer) -> None:
    """Raise a ZerorunError naming why when no way can run `optimizer`'s class."""
    for cls, reason in REFUSED:
        if isinstance(optimizer, cls):
            raise ZerorunError(f"zerorun.initialize got a {type(optimizer).__name__}: {reason}.")


def way_of(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> Way:
    """The way param group `group` of `optimizer` runs (the module docstring's table)."""
    cls = type(optimizer)
    if cls in (torch.optim.Adam, torch.optim.AdamW) and not any(group.get(flag) for flag in FUSED_BLOCKERS):
        return Way.FUSED_ADAM
    if cls in TORCH_ELEMENTWISE or isinstance(optimizer, Elementwise) or (cls.__module__, cls.__name__) in \
            KNOWN_ELEMENTWISE:
        return Way.ELEMENTWISE
    return Way.OWNER


def decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether a fused Adam group decays weights decoupled (AdamW, or Adam(decoupled_weight_decay=True))."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))


def whole_cost(optimizer: torch.optim.Optimizer) -> Cost:
    """What an owner-way optimizer's update of a whole parameter costs, by its shape: Newton-Schulz's for a Muon
    (torch's, or a class of that name), else the parameter's size."""
    return matrix_cost if isinstance(optimizer, torch.optim.Muon) or "muon" in type(optimizer).__name__.lower() \
        else size_cost
