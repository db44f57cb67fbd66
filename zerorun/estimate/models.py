"""Model shapes for the planner: a model factory built on the meta device (no memory touched), or a size."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch
from torch import nn

from zerorun.errors import ZerorunError
from zerorun.estimate.plan import MIB, ModelShape


def load_factory(spec: str) -> Any:
    """`package.module:function` -> the callable (a class works too)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ZerorunError(f"--model {spec!r}: expected module:function, e.g. zerorun.bench.gpt:GPT.")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m`: a module beside you imports
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ZerorunError(f"--model {spec!r}: cannot import {module_name} ({exc}).") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ZerorunError(f"--model {spec!r}: {module_name} has no callable {attr}.")
    return factory


def build_on_meta(spec: str) -> nn.Module:
    """Call the factory under the meta device: shapes only, no memory."""
    factory = load_factory(spec)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:  # the user's code: any failure is a bad --model
        raise ZerorunError(f"--model {spec!r}: building it on the meta device failed: "
                           f"{type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ZerorunError(f"--model {spec!r}: returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def shape_of(model: nn.Module, wrap: list[str], persistence_threshold: int, bucket_mb: float) -> ModelShape:
    """Count a model's parameters the way stage 3 plans its units (`runtime/stage3/module_units.py`)."""
    from zerorun.runtime.optim.recipe_optimizers import muon_takes
    from zerorun.runtime.stage3.module_units import split_modules, wrapped_modules

    trainable = {p for p in model.parameters() if p.requires_grad}
    persistent = {p for p in trainable if p.numel() < persistence_threshold}
    sharded = trainable - persistent
    bucket_numel = int(bucket_mb * MIB) // 4
    modules = [mod for _, mod in wrapped_modules(model, wrap, bucket_numel)]
    split = split_modules(model, modules, max(1, bucket_numel // 2))  # as plan_stage3
    modules += [mod for _, mod in split]
    units = [{p for p in mod.parameters() if p in sharded} for mod in modules]
    owners: dict[nn.Parameter, int] = {}
    for unit in units:
        for p in unit:
            owners[p] = owners.get(p, 0) + 1
    in_one = [{p for p in unit if owners[p] == 1} for unit in units]
    root = sharded - {p for unit in in_one for p in unit}
    count = lambda params: sum(p.numel() for p in params)  # noqa: E731
    matrices = [p for p in trainable if p.ndim >= 2]
    names = {p: name for name, p in model.named_parameters()}
    lone = [[p for p in mod.parameters() if p in sharded] for _, mod in split]
    return ModelShape(params=count(trainable), largest_unit=max((count(u) for u in in_one), default=0),
                      root=count(root), persistent=count(persistent), matrices=count(matrices),
                      matrix_edges=sum(p.numel() // p.shape[-1] + p.numel() // p.shape[-2] for p in matrices),
                      lone_split=sum(count(u) for u in lone if len(u) == 1),
                      lone_muon_split=sum(count(u) for u in lone if sum(muon_takes(names[p], p) for p in u) == 1))


def shape_from_size(params: float, largest_layer: int | None, hidden: int | None) -> ModelShape:
    """A model given only by its size: the largest unit from --largest-layer, else a block of width --hidden."""
    if largest_layer is None and hidden is not None:
        largest_layer = 12 * hidden * hidden + 13 * hidden  # attention 4h^2 + MLP 8h^2, biases and norms
    return ModelShape(params=int(params), largest_unit=largest_layer or 0)


