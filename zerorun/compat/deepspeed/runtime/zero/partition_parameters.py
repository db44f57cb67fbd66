"""`deepspeed.runtime.zero.partition_parameters`: the tensor-constructor hook transformers swaps around `zero.Init`.

DeepSpeed's `zero.Init` wraps torch's tensor constructors to cast and place new tensors; transformers
replaces that wrapper (`prevent_arange_dtype_change`) so RoPE's `torch.arange` keeps its dtype.
zerorun's `zero.Init` wraps no constructor, so the wrapper here returns the constructor unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerorun.compat.deepspeed.accelerator import get_accelerator
from zerorun.compat.deepspeed.zero import GatheredParameters, Init

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], target_fp_dtype: Any = None,
                                           target_device: Any = None) -> Callable[..., Any]:
    return fn


__all__ = ["GatheredParameters", "Init", "get_accelerator", "zero_wrapper_for_fp_tensor_constructor"]
