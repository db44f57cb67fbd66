"""The optimizers a recipe's `optimizer` section names, built as torch optimizers over the model.

`zerorun.initialize(model)` without an optimizer trains with these; they are handed over like a
script's own (take_over.py), so the recipe's optimizer and a script's run the same way. `muon` is
two optimizers, as torch's documentation recommends and DeepSpeed's `Muon` type builds: torch's
Muon for the hidden matrices (2-D parameters whose names contain neither `embed` nor `lm_head`),
AdamW for the rest.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerorun.config import OptimizerConfig
from zerorun.runtime.optim.classes import Lamb, Lion


def muon_takes(name: str, param: nn.Parameter) -> bool:
    """Whether the recipe's (and DeepSpeed's) `muon` gives a parameter to Muon rather than to its AdamW."""
    return param.ndim == 2 and "embed" not in name and "lm_head" not in name


def from_recipe(cfg: OptimizerConfig, model: nn.Module, groups: Any = None) -> list[torch.optim.Optimizer]:
    """The recipe's optimizer(s) over `groups` (param groups or parameters, as torch optimizers take them: a
    DeepSpeed script's `model_parameters`), or over every trainable parameter of `model`."""
    params = groups if groups is not None else [p for p in model.parameters() if p.requires_grad]
    adam: dict[str, Any] = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.type == "muon":
        names = {p: n for n, p in model.named_parameters()}
        given = list(params)
        listed: list[dict[str, Any]] = given if given and isinstance(given[0], dict) else [{"params": given}]
        matrices = [{**g, "params": [p for p in g["params"] if muon_takes(names[p], p)]} for g in listed]
        rest = [{**g, "params": [p for p in g["params"] if not muon_takes(names[p], p)]} for g in listed]
        muon = built(torch.optim.Muon, [g for g in matrices if g["params"]], lr=cfg.lr,
                     weight_decay=cfg.weight_decay, **_given(momentum=cfg.momentum, nesterov=cfg.nesterov)) \
            if any(g["params"] for g in matrices) else None
        adamw = built(torch.optim.AdamW, [g for g in rest if g["params"]], **{**adam, "lr": cfg.adam_lr or cfg.lr}) \
            if any(g["params"] for g in rest) else None
        return [opt for opt in (muon, adamw) if opt is not None]
    decay = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    build = {
        "adamw": lambda: built(torch.optim.AdamW, params, **adam),
        "adam": lambda: built(torch.optim.Adam, params, **adam),
        "sgd": lambda: built(torch.optim.SGD, params, **decay, **_given(momentum=cfg.momentum, nesterov=cfg.nesterov)),
        "lion": lambda: built(Lion, params, **decay, betas=(cfg.betas[0], cfg.betas[1])),
        "adagrad": lambda: built(torch.optim.Adagrad, params, **decay, eps=cfg.eps),
        "rmsprop": lambda: built(torch.optim.RMSprop, params, **decay, eps=cfg.eps, **_given(momentum=cfg.momentum)),
        "adafactor": lambda: built(torch.optim.Adafactor, params, **decay),
        "lamb": lambda: built(Lamb, params, **adam),
    }
    return [build[cfg.type]()]


def built(cls: type[torch.optim.Optimizer], params: Any, **options: Any) -> torch.optim.Optimizer:
    """`cls(params, **options)` without the compiler stack: torch's `Optimizer.add_param_group`, which its constructor
    calls, is wrapped in `torch._disable_dynamo`, whose first call imports torch._dynamo, inductor and sympy (tens of
    MiB of RSS per rank, tests/runtime/test_sharded_init.py). The unwrapped function stands in, on this new object
    only, while it is built; a script's own optimizer is built by the script, as it chose."""
    optimizer = cls.__new__(cls)
    add = torch.optim.Optimizer.add_param_group
    vars(optimizer)["add_param_group"] = lambda group: getattr(add, "__wrapped__", add)(optimizer, group)
    try:
        cls.__init__(optimizer, params, **options)
    finally:
        del vars(optimizer)["add_param_group"]
    return optimizer


def _given(**values: Any) -> dict[str, Any]:
    """The keyword arguments the recipe set (null: the optimizer's own default)."""
    return {k: v for k, v in values.items() if v is not None}
