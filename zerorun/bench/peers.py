"""The peers `zerorun bench step` runs zerorun beside: DDP, FSDP2 and DeepSpeed, each with the bench's optimizer.

Each is built as its own documentation builds it, over the same model, with the optimizer the recipe's
keys build for zerorun (`optimizer_keys`), or DDP's strong baseline, AdamW(fused=True). DeepSpeed with
muon runs its own Muon (MuonWithAuxAdam), which splits the parameters as the recipe's muon does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from zerorun.bench import compiling

if TYPE_CHECKING:
    from zerorun.bench.step_results import StepBenchConfig


def optimizer_keys(cfg: StepBenchConfig) -> list[str]:
    """The recipe keys of the benchmark's optimizer (lr 1e-4; SGD with momentum, as it is trained)."""
    return [f"optimizer.type={cfg.optimizer}", "optimizer.lr=1e-4",
            *(["optimizer.momentum=0.9"] if cfg.optimizer == "sgd" else [])]


def _optimizers(model: torch.nn.Module, cfg: StepBenchConfig, fused: bool) -> list[torch.optim.Optimizer]:
    """The peers' optimizers: the ones the recipe's keys build for zerorun (`fused`: AdamW(fused=True))."""
    from zerorun import config
    from zerorun.runtime.optim.recipe_optimizers import from_recipe

    if fused and cfg.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)]
    return from_recipe(config.loads("script: bench", "<bench>", optimizer_keys(cfg)).optimizer, model)


def peers(system: str, model: torch.nn.Module, cfg: StepBenchConfig,
           compile: str | None = None) -> tuple[Any, list[torch.optim.Optimizer]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if system.startswith("deepspeed"):
        import deepspeed

        ds_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": cfg.micro_batch, "gradient_accumulation_steps": 1,
                                     "zero_optimization": {"stage": int(system[-1])},
                                     "zero_allow_untested_optimizer": True}
        if cfg.optimizer == "muon":  # DeepSpeed's own Muon (MuonWithAuxAdam): its split is the recipe's muon's
            ds_config["optimizer"] = {"type": "Muon", "params": _deepspeed_muon(cfg)}
            if system == "deepspeed3":  # "Muon and reduce scatter cannot be used together"
                ds_config["zero_optimization"]["reduce_scatter"] = False
            torch._dynamo.config.disable = True  # its Newton-Schulz is compiled, which fails on a CPU host
            engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                     config=ds_config)
            return engine, [opt]
        opts = _optimizers(model, cfg, fused=True)
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opts[0], config=ds_config)
        return engine, [opt]
    if system.startswith("ddp"):
        if compile == "block":
            compiling.compile_blocks(model)
        wrapped = DDP(model)
        optimizers = _optimizers(model, cfg, fused=system == "ddp-fused")
        return (torch.compile(wrapped) if compile == "whole" else wrapped), optimizers
    from torch.distributed.fsdp import fully_shard

    for block in cast(torch.nn.ModuleList, model.blocks):
        fully_shard(block)
    fully_shard(model)
    return model, _optimizers(model, cfg, fused=False)


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def peer_state_mib(model: torch.nn.Module, opts: list[torch.optim.Optimizer]) -> float:
    params = sum(_local_bytes(p) + _local_bytes(p.grad) for p in model.parameters())
    states = sum(_local_bytes(v) for opt in opts for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor))
    return (params + states) / 2**20


def _deepspeed_muon(cfg: StepBenchConfig) -> dict[str, Any]:
    """DeepSpeed's Muon settings: the recipe's (lr, weight decay, torch Muon's momentum)."""
    from zerorun import config

    recipe = config.loads("script: bench", "<bench>", optimizer_keys(cfg)).optimizer
    return {"lr": recipe.lr, "weight_decay": recipe.weight_decay, "momentum": recipe.momentum or 0.95}
