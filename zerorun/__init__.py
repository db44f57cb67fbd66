"""zerorun: a training launcher and ZeRO runtime for PyTorch.

In a training script:

    import zerorun
    recipe = zerorun.recipe()                 # the recipe the launcher injected
    engine = zerorun.initialize(model)        # ZeRO stage, precision, optimizer from the recipe
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Union

from zerorun.version import __version__  # noqa: F401 - the package's version, as zerorun.__version__

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LRScheduler

    from zerorun.config import Recipe
    from zerorun.runtime.engine import Engine

    # a scheduler on the script's optimizer, or a function that builds one on the engine's optimizer
    SchedulerArg = Union[LRScheduler, Callable[[Optimizer], LRScheduler], None]

def recipe() -> Recipe:
    """The recipe this worker was launched with (defaults plus the script itself outside a launch), read once per
    runtime (zerorun/runtime/context.py)."""
    from zerorun import config
    from zerorun.runtime import context

    runtime = context.current()
    if runtime.recipe is None:
        runtime.recipe = config.from_env() or config.from_dict({"script": sys.argv[0] or "<interactive>"}, "<defaults>")
    return runtime.recipe


def sharded_init() -> Any:
    """Context manager: models built inside never exist whole on any rank (see zerorun.runtime.stage3.sharded_init)."""
    from zerorun.runtime import context
    from zerorun.runtime.stage3.sharded_init import InitLogs
    from zerorun.runtime.stage3.sharded_init import sharded_init as _sharded_init

    return _sharded_init(context.current().part(InitLogs))


def initialize(model: nn.Module, optimizer: Optimizer | list[Optimizer] | None = None, config: Recipe | None = None,
               lr_scheduler: SchedulerArg = None) -> Engine:
    """Wrap `model` in a ZeRO engine.

    `optimizer`: any torch optimizer, or a list of them over disjoint parameters (Muon for the matrices and
    AdamW for the rest), whose param groups, hyper-parameters and state are taken over and which performs the
    update over what each rank owns (docs/optimizers.md: how each kind runs); None: the recipe's `optimizer`
    section. `lr_scheduler`: a torch LR scheduler on that optimizer (or a function of the engine's
    optimizer that builds one) that the engine steps after every applied update, as DeepSpeed's does;
    without it the recipe's `scheduler` section, if any, is built and stepped the same way. Schedulers
    the script builds and steps itself are found, saved with every checkpoint and restored on resume.
    """
    from zerorun.runtime.engine import Engine

    chosen = config or recipe()
    lr_scheduler, source = _recipe_choices(chosen, optimizer, lr_scheduler)
    # a zerorun script loops to the recipe's train.steps (docs/training-script.md): the progress counts to it where
    # the user gave it; a script counting its own loop against the default would show a total it never set
    from zerorun.config import known_steps

    return start(Engine(model, optimizer, chosen, lr_scheduler, source), total_steps=known_steps(chosen))


# names imported on first use (they need torch): zerorun.Elementwise declares an optimizer class elementwise
# (runtime/optim/ways.py); zerorun.Lion and zerorun.Lamb are the optimizers torch lacks (runtime/optim/classes.py)
_LAZY = {"Elementwise": "zerorun.runtime.optim.ways", "Lion": "zerorun.runtime.optim.classes",
         "Lamb": "zerorun.runtime.optim.classes"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zerorun' has no attribute {name!r}")


def start(engine: Engine, total_steps: int | None) -> Engine:
    """What every entry point (this one, the DeepSpeed facade) does with a new engine: resume as
    `checkpoint.resume` asks, then attach the telemetry probe, telling it the steps the script will run
    where they are known (None: the launcher's progress shows no total)."""
    engine.resume()  # checkpoint.resume (auto: the latest in checkpoint.dir); see engine.resumed_from
    try:  # the telemetry probe (when the launcher started one) reads memory and model FLOPs from it
        from zerorun.telemetry import probe

        probe.attach_engine(engine, total_steps)
    except Exception:  # noqa: BLE001 - telemetry never breaks initialize
        pass
    _open_profile_window(engine)
    return engine


def _open_profile_window(engine: Engine) -> None:
    """`telemetry.profile_start`: record a profiler trace on this rank (telemetry/profile.py); never fails a run."""
    try:
        from zerorun.telemetry import profile

        profile.attach(engine)
    except Exception as exc:  # noqa: BLE001 - profiling never breaks initialize
        import logging

        logging.getLogger("zerorun").warning("zerorun: profile off on this rank: %s: %s", type(exc).__name__, exc)


def _recipe_choices(recipe: Recipe, optimizer: Any, lr_scheduler: Any) -> tuple[Any, str | None]:
    """The scheduler the engine steps, and where the recipe asked for it; a conflict between the recipe's
    `optimizer`/`scheduler` sections and what the script passes is refused, naming both."""
    from zerorun import config
    from zerorun.errors import ZerorunError

    given = config.given_in(recipe, "optimizer")
    if optimizer is not None and given:
        keys = ", ".join(f"{k} ({where})" for k, where in given.items() if k != "optimizer") or f"optimizer " \
                                                                                             f"({given['optimizer']})"
        raise ZerorunError(
            f"the recipe sets {keys}, but the script passes its own {_names(optimizer)} to "
            f"zerorun.initialize, whose param groups and hyper-parameters the engine takes over: the recipe's "
            f"values would be ignored. Remove them from the recipe, or call zerorun.initialize(model) without an "
            f"optimizer to train with the recipe's.")
    if recipe.scheduler.type == "none":
        return lr_scheduler, None
    where = config.given_in(recipe, "scheduler").get("scheduler.type", "the recipe")
    if lr_scheduler is not None:
        raise ZerorunError(f"the recipe's scheduler section ({where}: {recipe.scheduler.type}) and the script's "
                           f"lr_scheduler= both ask to drive the learning rate; remove one of them.")
    from zerorun.runtime.optim import schedules

    return (lambda opt: schedules.build(recipe.scheduler, opt, recipe.train.steps)), f"scheduler.type at {where}"


def _names(optimizer: Any) -> str:
    """`AdamW`, or `Muon + AdamW` for a list."""
    return " + ".join(type(o).__name__ for o in optimizer) if isinstance(optimizer, (list, tuple)) else \
        type(optimizer).__name__
