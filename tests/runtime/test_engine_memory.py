"""Per-rank engine.memory() equals the ZeRO formulas (fp32 and bf16 AdamW) within 2%."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_ranks

# bytes per parameter of model states (params + grads + master + moments) on N ranks.
# fp32: the parameters are the master weights. bf16: 2-byte parameters, gradients accumulated in
# fp32 (full in stages 0/1, a 1/N shard in stage 2), fp32 master + moments sharded from stage 1.
FORMULAS = {
    ("fp32", 0): lambda n: 16,
    ("fp32", 1): lambda n: 8 + 8 / n,
    ("fp32", 2): lambda n: 4 + 12 / n,
    ("bf16", 0): lambda n: 18,
    ("bf16", 1): lambda n: 6 + 12 / n,
    ("bf16", 2): lambda n: 2 + 16 / n,
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(301, 517), nn.GELU(), nn.Linear(517, 299), nn.LayerNorm(299), nn.Linear(299, 7))


def _measure(rank: int, world: int) -> dict:
    import zerorun
    from zerorun import config

    out = {}
    for (dtype, stage) in FORMULAS:
        recipe = config.loads("script: t.py", "t.yaml", [f"zero.stage={stage}", f"precision.dtype={dtype}",
                                                          "zero.bucket_mb=0.25"])
        model = _model()
        engine = zerorun.initialize(model, None, recipe)
        x = torch.randn(4, 301)
        for _ in range(2):  # the gradient buffers must be what steady state holds
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        report = engine.memory()
        params = sum(p.numel() for p in model.parameters())
        out[(dtype, stage)] = (report.model_states(), params, report.as_dict())
        engine.reducer.remove_hooks()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_model_state_bytes_match_zero_formulas(world: int) -> None:
    results = run_ranks(_measure, world)
    for rank, measured in enumerate(results):
        for key, (nbytes, params, detail) in measured.items():
            expected = FORMULAS[key](world) * params
            assert abs(nbytes - expected) / expected < 0.02, (
                f"{key} rank {rank}/{world}: {nbytes} B vs formula {expected:.0f} B ({detail})")
