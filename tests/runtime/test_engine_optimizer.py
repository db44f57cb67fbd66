"""The engine takes over the user's Adam(W) param groups, works with stock LR schedulers, and rejects what it cannot honour."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.harness import run_ranks
from tests.runtime.reference import batch, make_model

STEPS = 10


def _groups(model: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.2, "lr": 4e-3},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3, "betas": (0.8, 0.99), "eps": 1e-6}]


def _schedule(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.9 ** step  # warm-up then decay


def _train(rank: int, world: int, stage: int, opt_cls: type) -> tuple[list[float], list[float]]:
    import zerorun
    from zerorun import config
    from zerorun.runtime.dist import init_distributed

    init_distributed()
    losses = {}
    for system in ("ddp", "zerorun"):
        model = make_model(0)
        opt = opt_cls(_groups(model), lr=1e-3)
        if system == "ddp":
            forward, backward, step = DDP(model), (lambda loss: loss.backward()), opt.step
            sched_target = opt
        else:
            recipe = config.loads("script: t.py", "t.yaml", [f"zero.stage={stage}", "zero.bucket_mb=0.0005"])
            engine = zerorun.initialize(model, opt, recipe)
            forward, backward, step = engine, engine.backward, engine.step
            sched_target = engine.optimizer
        sched = torch.optim.lr_scheduler.LambdaLR(sched_target, _schedule)
        out = []
        for i in range(STEPS):
            loss = forward(batch(0, rank, i))
            backward(loss)
            step()
            if system == "ddp":
                opt.zero_grad()
            sched.step()
            out.append(loss.item())
        losses[system] = out
    return losses["ddp"], losses["zerorun"]


@pytest.mark.parametrize("stage, opt_cls", [(1, torch.optim.AdamW), (2, torch.optim.Adam)])
def test_param_groups_and_lr_scheduler_match_ddp(stage: int, opt_cls: type) -> None:
    for ddp_losses, our_losses in run_ranks(_train, 2, (stage, opt_cls)):
        assert torch.allclose(torch.tensor(our_losses), torch.tensor(ddp_losses), rtol=1e-5, atol=0), (
            our_losses, ddp_losses)
        assert len(set(our_losses)) > 1


def _errors(rank: int, world: int) -> list[str]:
    import zerorun
    from zerorun import config
    from zerorun.errors import ZerorunError

    recipe = config.loads("script: t.py", "t.yaml")
    messages = []
    attempts = [
        lambda m: zerorun.initialize(m, torch.optim.SGD(m.parameters(), lr=1), recipe),
        lambda m: zerorun.initialize(m, torch.optim.AdamW(m.parameters(), amsgrad=True), recipe),
        lambda m: zerorun.initialize(m, torch.optim.AdamW([m.up.weight]), recipe),
    ]
    for attempt in attempts:
        try:
            attempt(make_model(0))
            messages.append("no error")
        except ZerorunError as exc:
            messages.append(str(exc))
    engine = zerorun.initialize(make_model(0), None, recipe)
    try:
        engine(batch(0, rank, 0)).backward()
        messages.append("no error")
    except ZerorunError as exc:
        messages.append(str(exc))
    try:
        engine.optimizer.step()
        messages.append("no error")
    except ZerorunError as exc:
        messages.append(str(exc))
    return messages


def test_unsupported_optimizers_and_misuse_give_clear_errors() -> None:
    sgd, amsgrad, stray, outside, direct = run_ranks(_errors, 1)[0]
    assert "takes over torch.optim.Adam or AdamW, got SGD" in sgd
    assert "amsgrad=True is not supported" in amsgrad
    assert "trainable parameters missing from the optimizer's param groups: embed.weight" in stray
    assert "call engine.backward(loss), not loss.backward()" in outside
    assert "call engine.step()" in direct
