"""Checkpoints of any optimizer's state resume at another world size, another stage and across the two ways.

Data are the global batches of test_checkpoint.py (each micro-step one batch of 6 sequences, split over
the ranks), so 2 and 3 ranks compute the same global gradient up to the order of the sums and a run that
changes world size halfway is compared with the run that did not. A change of world size changes that
order, and torch's Muon turns a rounding of its input into a bf16 ulp of its Newton-Schulz step: the
bounds are the any-optimizer parity's (test_any_optimizer.py), not bit-equality.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.optimizers import OPTIMIZERS, PlainSubclass, tolerance
from tests.runtime.reference import engine_master_params, make_model
from tests.runtime.test_checkpoint import ACCUM, _train

STEPS = 12  # optimizer steps, of ACCUM micro-steps (test_checkpoint.py's data and loop)


def _engine(name: str, overrides: list[str]):
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [f"train.grad_accum_steps={ACCUM}", "zero.bucket_mb=0.0005",
                                                        "checkpoint.resume=never", *overrides])
    model = make_model(0)
    opts = OPTIMIZERS[name](model)
    return zerorun.initialize(model, opts if len(opts) > 1 else opts[0], recipe)


def _save_half(rank: int, world: int, name: str, overrides: list[str], directory: str, steps: int = STEPS) -> dict:
    """The uninterrupted run, then a fresh one saved halfway (`directory`)."""
    whole = _engine(name, overrides)
    losses = _train(whole, rank, world, 0, steps)
    final = _plain(engine_master_params(whole))
    whole.destroy()
    half = _engine(name, overrides)
    _train(half, rank, world, 0, steps // 2)
    half.save_checkpoint(directory, block=True)
    memory = half.memory()
    return {"losses": losses, "final": final, "optimizer_bytes": memory.total("optimizer"),
            "imbalance": memory.optimizer_imbalance}


def _resume(rank: int, world: int, name: str, overrides: list[str], directory: str, steps: int = STEPS) -> dict:
    engine = _engine(name, overrides)
    engine.load_checkpoint(directory)
    return {"losses": _train(engine, rank, world, steps // 2, steps), "final": _plain(engine_master_params(engine)),
            "step": engine.global_step}


def _plain(params: dict[str, torch.Tensor]) -> dict[str, list]:
    """Parameters as lists: a rank's result crosses to the test process without sharing tensor memory."""
    return {n: t.tolist() for n, t in params.items()}


def _mean(ranks: list[list[float]]) -> torch.Tensor:
    return torch.tensor(ranks, dtype=torch.float64).mean(dim=0)


def _gaps(saved: list[dict], resumed: list[dict]) -> tuple[float, float]:
    got = _mean([r["losses"] for r in resumed])
    expected = _mean([s["losses"] for s in saved])[-len(got):]
    loss_gap = ((got - expected).abs() / expected.abs()).max().item()
    param_gap = max((torch.tensor(resumed[0]["final"][n]) - torch.tensor(v)).abs().max().item()
                    for n, v in saved[0]["final"].items())
    return loss_gap, param_gap


@pytest.mark.slow
def test_muon_and_adamw_saved_on_3_ranks_at_stage_2_resume_on_2_ranks_at_stage_3(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = run_ranks(_save_half, 3, ("muon+adamw", ["zero.stage=2"], directory))
    resumed = run_ranks(_resume, 2, ("muon+adamw", ["zero.stage=3"], directory))
    assert all(r["step"] == STEPS for r in resumed)
    loss_gap, param_gap = _gaps(saved, resumed)
    loss_bound, param_bound = tolerance("muon+adamw")
    assert loss_gap <= loss_bound and param_gap <= param_bound, (loss_gap, param_gap)
    # each of the 3 ranks held a third of the state (whole matrices per rank: within the reported imbalance)
    total = sum(s["optimizer_bytes"] for s in saved)
    for s in saved:
        assert s["optimizer_bytes"] <= total / 3 * s["imbalance"] + 1024, (s["optimizer_bytes"], total, s["imbalance"])


def test_muon_and_adamw_saved_at_stage_2_resume_at_stage_3(tmp_path) -> None:
    """The development tier's case: the owned state (async save) and the fused one, into another layout."""
    saved = run_ranks(_save_half, 2, ("muon+adamw", ["zero.stage=2"], str(tmp_path), 2))
    resumed = run_ranks(_resume, 2, ("muon+adamw", ["zero.stage=3"], str(tmp_path), 2))
    loss_gap, param_gap = _gaps(saved, resumed)
    assert loss_gap <= 1e-5 and param_gap <= 3e-4, (loss_gap, param_gap)


def _across_ways(rank: int, world: int, root: str, nvme: str) -> list[tuple[str, float, float]]:
    """SGD saved over flat shards resumed on whole parameters (a subclass zerorun does not know), and back; Muon +
    AdamW saved from NVMe resumed in memory. Each against its own uninterrupted run."""
    offload = ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={nvme}",
               "zero.offload_optimizer.buffer_mb=0.0002", "checkpoint.async_save=false"]
    cases = [("sgd-nesterov", ["zero.stage=2"], "subclass", ["zero.stage=1", "checkpoint.allow_changes=true"]),
             ("subclass", ["zero.stage=3"], "sgd-nesterov", ["zero.stage=2", "checkpoint.allow_changes=true"]),
             ("muon+adamw", ["zero.stage=2", *offload], "muon+adamw", ["zero.stage=2"])]
    out = []
    for i, (name, overrides, then, resumed_with) in enumerate(cases):
        saved = _save_half(rank, world, name, overrides, f"{root}/{i}")
        resumed = _resume(rank, world, then, resumed_with, f"{root}/{i}")
        out.append((f"{name} -> {then}", saved, resumed))
    return [(case, s["losses"], r["losses"], s["final"], r["final"]) for case, s, r in out]


@pytest.mark.slow
def test_a_state_saved_over_flat_shards_resumes_on_whole_parameters_and_back_and_from_nvme(tmp_path,
                                                                                        direct_io_dir) -> None:
    ranks = run_ranks(_across_ways, 2, (str(tmp_path), str(direct_io_dir)))
    for i, (case, *_rest) in enumerate(ranks[0]):
        saved = [{"losses": r[i][1], "final": r[i][3]} for r in ranks]
        resumed = [{"losses": r[i][2], "final": r[i][4]} for r in ranks]
        loss_gap, param_gap = _gaps(saved, resumed)
        assert loss_gap <= 1e-5 * (10 if "muon" in case else 1) and param_gap <= 3e-4, (case, loss_gap, param_gap)
    assert PlainSubclass.__mro__[1] is torch.optim.SGD  # the same update, so the two runs must agree
