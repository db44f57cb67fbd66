"""zerorun: a training launcher and ZeRO runtime for PyTorch.

In a training script:

    import zerorun
    recipe = zerorun.recipe()                 # the recipe the launcher injected
    engine = zerorun.initialize(model)        # ZeRO stage, precision, optimizer from the recipe
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from zerorun.version import __version__  # noqa: F401 - the package's version, as zerorun.__version__

if TYPE_CHECKING:
    from zerorun.config import Recipe
    from zerorun.runtime.engine import Engine

_recipe: Recipe | None = None


def recipe() -> Recipe:
    """The recipe this worker was launched with (defaults plus the script itself outside a launch)."""
    global _recipe
    if _recipe is None:
        from zerorun import config

        _recipe = config.from_env() or config.from_dict({"script": sys.argv[0] or "<interactive>"}, "<defaults>")
    return _recipe


def sharded_init() -> Any:
    """Context manager: models built inside never exist whole on any rank (see zerorun.runtime.sharded_init)."""
    from zerorun.runtime.sharded_init import sharded_init as _sharded_init

    return _sharded_init()


def initialize(model: Any, optimizer: Any = None, config: Recipe | None = None) -> Engine:
    """Wrap `model` (and optionally a torch Adam/AdamW whose param groups are taken over) in a ZeRO engine."""
    from zerorun.runtime.engine import Engine

    engine = Engine(model, optimizer, config or recipe())
    engine.resume()  # checkpoint.resume (auto: the latest in checkpoint.dir); see engine.resumed_from
    try:  # the telemetry probe (when the launcher started one) reads memory and model FLOPs from it
        from zerorun.telemetry import probe

        probe.attach_engine(engine)
    except Exception:  # noqa: BLE001 - telemetry never breaks initialize
        pass
    return engine
