"""zerorun's DeepSpeed-compatible API: what `import deepspeed` gives a script when the recipe sets
`launch.deepspeed_compat: true` (and `zerorun launch script.py` does); importable as
`zerorun.compat.deepspeed` without the switch.

    import deepspeed
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    engine, optimizer, _, scheduler = deepspeed.initialize(args=parser.parse_args(), model=model,
                                                           model_parameters=model.parameters())

Anything of DeepSpeed's that is not here fails where the script touches it, with a message naming it.
"""

from __future__ import annotations

from typing import Any

from zerorun import __version__ as _zerorun_version
from zerorun.compat.api import add_config_arguments, init_distributed, initialize
from zerorun.compat.deepspeed import accelerator, checkpoint, comm, ops, runtime, utils, zero
from zerorun.compat.engine import DeepSpeedEngine

API_VERSION = "0.19.8"  # the DeepSpeed release whose API this follows (transformers and accelerate check it)
__version__ = f"{API_VERSION}+zerorun.{_zerorun_version}"  # PEP 440: a local version marks it as zerorun's

__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "checkpoint", "comm", "init_distributed",
           "initialize", "ops", "runtime", "utils", "zero"]

_INSTEAD = {
    "init_inference": "zerorun trains; for inference use engine.module (or engine.state_dict()) directly",
    "checkpointing": "torch.utils.checkpoint (zerorun supports it at every stage)",
    "pipe": "zerorun has no pipeline parallelism",
    "moe": "zerorun has no expert parallelism",
}


def __getattr__(name: str) -> Any:
    hint = _INSTEAD.get(name, "see docs/deepspeed.md for what the compatibility covers")
    raise AttributeError(f"deepspeed.{name} is not provided by zerorun's DeepSpeed compatibility: {hint}.")
