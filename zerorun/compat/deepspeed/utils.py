"""`deepspeed.utils`: the logger transformers sets the level of, and DeepSpeed's ZeRO-3 leaf-module marker.

    from deepspeed.utils import logger, set_z3_leaf_modules
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from zerorun.errors import ZerorunError

logger = logging.getLogger("zerorun.deepspeed")  # transformers' deepspeed_init sets its level to the Trainer's


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[Any], raise_if_not_found: bool = True) -> list:
    """DeepSpeed's marker for modules gathered whole at stage 3 (mixture-of-experts layers): refused."""
    raise ZerorunError("deepspeed.utils.set_z3_leaf_modules is not provided by zerorun's DeepSpeed "
                              "compatibility: zerorun's stage 3 units are whole modules already; name the class in "
                              "the recipe's zero.wrap instead.")


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.utils.{name} is not provided by zerorun's DeepSpeed compatibility "
                         "(it serves logger and set_z3_leaf_modules).")
