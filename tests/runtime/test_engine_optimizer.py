"""The engine takes over the user's Adam(W) param groups, works with stock LR schedulers, and rejects what it cannot honour."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

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
    from zerorun.runtime.comm.dist import init_distributed

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


@pytest.mark.parametrize("stage, opt_cls", [pytest.param(1, torch.optim.AdamW, marks=pytest.mark.slow),
                                            (2, torch.optim.Adam)])
def test_param_groups_and_lr_scheduler_match_ddp(stage: int, opt_cls: type) -> None:
    for ddp_losses, our_losses in run_ranks(_train, 2, (stage, opt_cls)):
        assert torch.allclose(torch.tensor(our_losses), torch.tensor(ddp_losses), rtol=1e-5, atol=0), (
            our_losses, ddp_losses)
        assert len(set(our_losses)) > 1


WARMUP, TOTAL, ACCUM = 3, 8, 2


def _warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP)))


def _loop(forward, backward, step, opt, sched, rank: int) -> dict[str, list]:
    """TOTAL optimizer steps of ACCUM micro-steps; `sched` None sets each group's lr by hand."""
    losses, lrs = [], []
    bases = [g["lr"] for g in opt.param_groups]

    def set_by_hand(i: int) -> None:
        for group, base in zip(opt.param_groups, bases):
            group["lr"] = base * _warmup_cosine(i)
    if sched is None:
        set_by_hand(0)
    for i in range(TOTAL):
        for a in range(ACCUM):
            loss = forward(batch(0, rank, i * ACCUM + a))
            backward(loss / ACCUM)
            step()
            losses.append(loss.item())
        sched.step() if sched is not None else set_by_hand(i + 1)
        lrs.append([g["lr"] for g in opt.param_groups])
    return {"losses": losses, "lrs": lrs}


def _scheduled(rank: int, world: int, cases: list[tuple[str, str, int]]) -> dict:
    """DDP + AdamW with a warm-up + cosine LambdaLR, then the same loop through zerorun per case:
    (when the scheduler is built, which optimizer it is built on, stage); warnings recorded."""
    import zerorun
    from zerorun import config
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    model = make_model(0)
    opt = torch.optim.AdamW(_groups(model))
    ddp = DDP(model)

    def ddp_step() -> None:
        if (len(ddp_micro) + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()
        ddp_micro.append(1)
    ddp_micro: list[int] = []
    out = {"ddp": _loop(ddp, lambda loss: loss.backward(), ddp_step, opt,
                        torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine), rank)}
    for when, target, stage in cases:
        model = make_model(0)
        opt = torch.optim.AdamW(_groups(model))
        recipe = config.loads("script: t.py", "t.yaml", [f"zero.stage={stage}", "zero.bucket_mb=0.0005",
                                                          f"train.grad_accum_steps={ACCUM}"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine) if when == "before" else None
            engine = zerorun.initialize(model, opt, recipe)
            if when == "after":
                sched = torch.optim.lr_scheduler.LambdaLR(opt if target == "user" else engine.optimizer,
                                                          _warmup_cosine)
            run = _loop(engine, engine.backward, engine.step, opt, sched, rank)
        run["shared"] = engine.optimizer.param_groups is opt.param_groups
        run["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        out[f"{when}/{target}/stage{stage}"] = run
    return out


SCHEDULED = [("before", "user", 2), ("after", "user", 3), ("after", "engine", 1), ("by hand", "user", 2)]


def test_a_scheduler_on_the_users_optimizer_drives_the_engine_like_ddp_without_warnings() -> None:
    for rank, out in enumerate(run_ranks(_scheduled, 2, (SCHEDULED,))):
        ddp = out.pop("ddp")
        assert len({lr for step in ddp["lrs"] for lr in step}) > 4  # warm-up and decay, two groups apart
        for case, run in out.items():
            assert run["shared"], case
            assert run["warnings"] == [], (case, run["warnings"])
            assert run["lrs"] == ddp["lrs"], (case, run["lrs"], ddp["lrs"])  # the same arithmetic
            assert torch.allclose(torch.tensor(run["losses"]), torch.tensor(ddp["losses"]), rtol=1e-5, atol=0), (
                case, rank, run["losses"], ddp["losses"])


def _handed_over_misuse(rank: int, world: int) -> list[str]:
    import zerorun
    from zerorun import config

    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters())
    engine = zerorun.initialize(model, opt, config.loads("script: t.py", "t.yaml"))
    return [_message(call) for call in (opt.step, opt.zero_grad, opt.state_dict, lambda: opt.load_state_dict({}),
                                        engine.optimizer.state_dict, engine.optimizer.zero_grad)]


def _message(call: Callable[[], object]) -> str:
    """The ZerorunError `call` raises, or "no error"."""
    from zerorun.errors import ZerorunError

    try:
        call()
    except ZerorunError as exc:
        return str(exc)
    return "no error"


def test_the_handed_over_optimizer_refuses_to_step_and_says_what_to_call() -> None:
    step, zero_grad, save, load, engine_save, engine_zero = run_ranks(_handed_over_misuse, 1)[0]
    assert "call engine.step()" in step
    assert "engine.zero_grad()" in zero_grad and "engine.zero_grad()" in engine_zero
    assert save == engine_save == "no error"  # the whole state, gathered (test_optimizer_state_dict.py)
    assert "expected a dict with 'state' and 'param_groups'" in load


def _errors(rank: int, world: int) -> list[str]:
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py", "t.yaml")
    messages = []
    attempts = [
        lambda m: zerorun.initialize(m, torch.optim.LBFGS(m.parameters()), recipe),
        lambda m: zerorun.initialize(m, torch.optim.SparseAdam(m.parameters()), recipe),
        lambda m: zerorun.initialize(m, torch.optim.AdamW([m.up.weight]), recipe),
        lambda m: zerorun.initialize(m, [torch.optim.SGD(m.parameters(), lr=1), torch.optim.AdamW([m.up.weight])],
                                     recipe),
        lambda m: zerorun.initialize(m, [torch.optim.SGD(m.parameters(), lr=1), "adamw"], recipe),
    ]
    for attempt in attempts:
        messages.append(_message(lambda: attempt(make_model(0))))
    engine = zerorun.initialize(make_model(0), None, recipe)
    messages.append(_message(lambda: engine(batch(0, rank, 0)).backward()))
    messages.append(_message(engine.optimizer.step))
    return messages


def test_unsupported_optimizers_and_misuse_give_clear_errors() -> None:
    lbfgs, sparse, stray, twice, not_one, outside, direct = run_ranks(_errors, 1)[0]
    assert "LBFGS steps with a closure" in lbfgs and "plain DDP" in lbfgs
    assert "SparseAdam updates sparse gradients" in sparse
    assert "trainable parameters missing from the optimizer's param groups: embed.weight" in stray
    assert "is in param group 0 of the SGD (optimizer 0) and in param group 0 of the AdamW (optimizer 1)" in twice
    assert "optimizer[1]=...): expected a torch.optim.Optimizer (or a list of them), got str" in not_one
    assert "call engine.backward(loss), not loss.backward()" in outside
    assert "call engine.step()" in direct
