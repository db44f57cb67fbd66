"""A ported DDP script's own checkpoint holds zerorun's optimizer state (checkpoint/full_optimizer.py).

Under zerorun `optimizer.state_dict()`, called on every rank, is the dict DDP's optimizer returns after the same
training: the same param groups, and each parameter's state whole (Adam's moments and step through the fused
kernel, SGD's momentum run elementwise over the shard, Muon's momentum kept by its owner rank), whatever the
stage, the world size or where the state lives. Loaded back, before `zerorun.initialize` (as nanoGPT resumes) or
after it, at another stage, training goes on as DDP's does from its own state.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tests.harness import run_ranks
from tests.runtime.optimizers import OPTIMIZERS, STAGE3, Factory, ddp_run, sum_then_divide
from tests.runtime.reference import batch, engine_master_params, make_model

STEPS, MORE, ACCUM = 3, 2, 2
CASES = [  # (optimizer, where it is saved, where it is loaded)
    ("adamw", ["zero.stage=1"], ["zero.stage=3", *STAGE3]),
    ("adamw", ["zero.stage=2", "zero.offload_optimizer=cpu"], ["zero.stage=1"]),
    ("adamw", ["zero.stage=3", *STAGE3], ["zero.stage=2", "zero.offload_optimizer=cpu"]),
    ("sgd-nesterov", ["zero.stage=2"], ["zero.stage=3", *STAGE3]),
    ("muon+adamw", ["zero.stage=2"], ["zero.stage=0"]),
]
STATE_GAP = 1e-4  # relative, per tensor: the runs' gradients are summed in another order (test_any_optimizer.py)


def _recipe(overrides: list[str]) -> Any:
    from zerorun import config

    return config.loads("script: t.py\n", "t.yaml", [f"train.grad_accum_steps={ACCUM}", "zero.bucket_mb=0.0005",
                                                      "zero.allgather_bucket_mb=0.0005", "checkpoint.resume=never",
                                                      *overrides])


def _capturing(factory: Factory) -> tuple[Factory, list[torch.optim.Optimizer]]:
    made: list[torch.optim.Optimizer] = []

    def build(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
        made.extend(factory(model))
        return made
    return build, made


def _train(engine: Any, rank: int, first: int, steps: int) -> list[float]:
    losses = []
    for micro in range(first, first + steps * ACCUM):
        loss = engine(batch(0, rank, micro))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _differences(name: str, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    out = []
    if got["param_groups"] != want["param_groups"]:
        out.append(f"{name}: param groups {got['param_groups']} != DDP's {want['param_groups']}")
    if set(got["state"]) != set(want["state"]):
        out.append(f"{name}: state for parameters {sorted(got['state'])}, DDP's for {sorted(want['state'])}")
    for index, state in want["state"].items():
        mine = got["state"].get(index, {})
        if set(mine) != set(state):
            out.append(f"{name}: parameter {index} holds {sorted(mine)}, DDP's {sorted(state)}")
            continue
        for key, value in state.items():
            value, other = torch.as_tensor(value).float(), torch.as_tensor(mine[key]).float()
            gap = ((other - value).abs().max() / value.abs().max().clamp_min(1e-12)).item() if value.numel() else 0.0
            if other.shape != value.shape or gap > STATE_GAP:
                out.append(f"{name}: parameter {index} {key}: {tuple(other.shape)} vs {tuple(value.shape)}, "
                           f"relative gap {gap:.2e}")
    return out


def _save_and_resume(rank: int, world: int, cases: list[tuple[str, list[str], list[str]]]) -> list[str]:
    import zerorun
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    problems = []
    for name, saved_at, loaded_at in cases:
        build, ddp_opts = _capturing(OPTIMIZERS[name])
        ddp_run(rank, build, STEPS, ACCUM, hook=sum_then_divide)
        want = [opt.state_dict() for opt in ddp_opts]
        longer = ddp_run(rank, OPTIMIZERS[name], STEPS + MORE, ACCUM, hook=sum_then_divide)

        model = make_model(0)
        opts = OPTIMIZERS[name](model)
        engine = zerorun.initialize(model, opts if len(opts) > 1 else opts[0], _recipe(saved_at))
        _train(engine, rank, 0, STEPS)
        got = [opt.state_dict() for opt in opts]  # every rank, as the guide says
        problems += [f"{name} at {saved_at}: {p}" for g, w in zip(got, want) for p in _differences(name, g, w)]
        weights = engine_master_params(engine)
        engine.destroy()

        for when in ("before initialize", "after initialize"):
            model = make_model(0)
            model.load_state_dict(weights, strict=False)
            opts = OPTIMIZERS[name](model)
            if when == "before initialize":
                for opt, sd in zip(opts, got):
                    opt.load_state_dict(copy.deepcopy(sd))  # torch's load keeps the dict's tensors: training changes them
            engine = zerorun.initialize(model, opts if len(opts) > 1 else opts[0], _recipe(loaded_at))
            if when == "after initialize":
                for opt, sd in zip(opts, got):
                    opt.load_state_dict(copy.deepcopy(sd))
            counted = STEPS if name != "sgd-nesterov" else 0  # SGD keeps no step count
            if engine.global_step != counted:  # saves are tagged with the step the script counts, not step-0
                problems.append(f"{name} loaded {when}: the engine counts from {engine.global_step}, not {counted}")
            losses = torch.tensor(_train(engine, rank, STEPS * ACCUM, MORE))
            engine.destroy()
            expected = torch.tensor(longer.losses[STEPS * ACCUM:])
            gap = ((losses - expected).abs() / expected.abs()).max().item()
            if gap > 1e-4:
                problems.append(f"{name} saved at {saved_at}, loaded {when} at {loaded_at}: losses {losses.tolist()} "
                                f"vs DDP's {expected.tolist()} (gap {gap:.1e})")
    return problems


def test_the_optimizers_state_dict_is_ddps_and_resumes_at_another_stage_on_3_ranks() -> None:
    problems = [p for rank in run_ranks(_save_and_resume, 3, (CASES,), timeout=600) for p in rank]
    assert not problems, "\n".join(problems)


def _rank_zero_only(rank: int, world: int) -> str:
    import zerorun
    from zerorun.errors import ZerorunError

    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters())
    engine = zerorun.initialize(model, opt, _recipe(["zero.stage=2"]))
    _train(engine, rank, 0, 1)
    try:
        if rank == 0:
            opt.state_dict()  # as a DDP script saves: `if master_process:`
        _train(engine, rank, ACCUM, 1)
    except ZerorunError as exc:
        return str(exc)
    return "no error"


def test_a_state_dict_on_rank_0_alone_is_stopped_saying_so() -> None:
    for message in run_ranks(_rank_zero_only, 2, timeout=120):
        assert "state_dict" in message and "every rank" in message, message
