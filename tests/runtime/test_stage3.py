"""Stage 3 trains like DDP + AdamW: tied-embedding GPT, activation checkpointing, eval passes, 2 and 3 ranks."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from tests.harness import run_ranks, run_threads, seeded
from tests.runtime.reference import ddp_reference, engine_run, tied_gpt
from zerorun.runtime.stage3.unit_group import UnitKind

STEPS = 8
LOSS_RTOL = 1e-5
PARAM_ATOL = 5e-7  # as for stages 0-2 (see test_engine_parity.py)
# The key part of each qkv bias has an exactly-zero true gradient (softmax ignores a constant shift
# of the scores), so its gradient is rounding noise that Adam normalises into full-size steps:
# there, stage 2 and stage 3 alike end ~5e-6 from DDP while queries and values agree to 1e-8.
KEY_BIAS_ATOL = 2e-5


def _param_diff(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (ours - ref).abs()
    if name.endswith("qkv.bias"):
        d = diff.numel() // 3
        key = diff[d:2 * d].max().item()
        diff = torch.cat([diff[:d], diff[2 * d:]])
        if key > KEY_BIAS_ATOL:
            return float("inf")
    return diff.max().item()
BASE = ["zero.stage=3", "zero.wrap=[Block]", "zero.param_persistence_threshold=30"]


def _compare(rank: int, world: int, cases: list[tuple[str, int, list[str]]]) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    problems = []
    for checkpoint, accum, extra in cases:
        model_fn = functools.partial(tied_gpt, checkpoint=checkpoint)
        ref = ddp_reference(rank, STEPS, accum, model_fn=model_fn, eval_every=3)
        run, engine = engine_run(rank, STEPS, accum, BASE + extra, model_fn=model_fn, eval_every=3)
        name = f"checkpoint={checkpoint} accum={accum} {extra} world={world} rank={rank}"
        for what, ours, theirs in (("losses", run.losses, ref.losses), ("eval losses", run.eval_losses, ref.eval_losses),
                                   ("grad norms", run.grad_norms, ref.grad_norms)):
            ours_t, theirs_t = torch.tensor(ours), torch.tensor(theirs)
            if ours_t.shape != theirs_t.shape or not torch.allclose(ours_t, theirs_t, rtol=LOSS_RTOL, atol=0):
                problems.append(f"{name}: {what} {ours[:3]} vs DDP {theirs[:3]}")
        for pname, value in ref.params.items():
            diff = _param_diff(pname, run.params[pname], value)
            if diff > PARAM_ATOL:
                problems.append(f"{name}: parameter {pname} differs by {diff:.2e}")
        if ONE_PARAMETER_UNITS[0] in extra and engine.reducer.direct_launches == 0:
            problems.append(f"{name}: no one-parameter unit was reduced from its own gradient")
        engine.destroy()
    return problems


# every parameter a unit of its own: the weight matrices (no padding on 2 or 3 ranks) are reduce-scattered
# from autograd's gradients directly, with no staging copy
ONE_PARAMETER_UNITS = ["zero.allgather_bucket_mb=0.000001"]
CASES = [("none", 2, []), ("reentrant", 2, []), ("non-reentrant", 1, []),
         ("none", 2, ["zero.prefetch_units=0", "zero.overlap_comm=false"]), ("none", 1, ["zero.wrap=[]", "zero.bucket_mb=0.001"]),
         ("none", 2, ONE_PARAMETER_UNITS)]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks: CI, not the development tier
def test_stage3_matches_ddp_adamw_with_tied_weights_checkpointing_and_eval(world: int) -> None:
    problems = [p for rank_problems in run_threads(_compare, world, (CASES,)) for p in rank_problems]
    assert not problems, "\n".join(problems)


def _memory(rank: int, world: int) -> dict:
    import zerorun
    from zerorun import config
    from zerorun.bench.gpt import GPT, GPTConfig, synthetic_tokens

    cfg = GPTConfig(layers=6, d_model=64, heads=4, vocab=300, seq_len=16)
    with seeded(0):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    threshold = 1000
    persistent = sum(p.numel() for p in model.parameters() if p.numel() < threshold)
    recipe = config.loads("script: t.py", "t.yaml", ["zero.stage=3", "zero.wrap=[Block]", "zero.prefetch_units=1",
                                                      f"zero.param_persistence_threshold={threshold}"])
    engine = zerorun.initialize(model, None, recipe)
    for i in range(3):
        engine.backward(engine(synthetic_tokens(cfg, 2, 0, rank, i)))
        engine.step()
    store = engine.store
    unit_bytes = {g.kind.value: [sum(store.buffers.full[k].numel() * 4 for k in g.slots)] for g in store.groups}
    blocks = [sum(store.buffers.full[k].numel() * 4 for k in g.slots) for g in store.plan.gathered_units()]
    # overlap_comm: the next forward's first block is already gathering when step() returns (reported as
    # "gathered" working memory, not as a model state)
    prefetched = sum(sum(store.buffers.full[k].numel() * 4 for k in g.slots) for g in store.plan.gathered_units()
                     if g.kind.value == "wrapped" and g.state.value != "released")
    return {"model_states": engine.memory().model_states(), "params": params, "persistent": persistent,
            "prefetched": prefetched,
            "peak": store.buffers.peak_gathered_bytes, "root": unit_bytes["root"][0], "persistent_bytes": unit_bytes["persistent"][0],
            "largest_block": max(blocks), "all_blocks": sum(blocks)}


@pytest.mark.parametrize("world", [2, 3])
def test_stage3_memory_at_rest_is_16_over_n_and_gathering_stays_in_the_prefetch_window(world: int) -> None:
    for rank, m in enumerate(run_threads(_memory, world)):
        expected = 16 / world * m["params"] + 4 * m["persistent"]  # fp32 AdamW + persistent params kept whole
        assert 0 < m["prefetched"] <= m["largest_block"], (rank, m)  # prefetch_units=1 block, started by step()
        assert abs(m["model_states"] - expected) / expected < 0.02, (rank, m, expected)
        # in use, prefetched, and the one whose gradients are on their way: at most 3 blocks at once
        window = m["root"] + m["persistent_bytes"] + 3 * m["largest_block"]
        assert m["peak"] <= window < m["root"] + m["persistent_bytes"] + m["all_blocks"], (rank, m)


def _gathered(rank: int, world: int) -> dict:
    import zerorun
    from zerorun import config

    engine = zerorun.initialize(tied_gpt(0), None, config.loads("script: t.py", "t.yaml", BASE))
    model = engine.module
    full = engine.state_dict()  # rank 0 only
    with engine.gathered():
        reads_match = rank != 0 or all(torch.equal(p.detach(), full[n]) for n, p in model.named_parameters())
    released = model.blocks[0].fc.weight.numel() == 0  # gathered only inside the block
    target = model.blocks[1].fc.weight
    with engine.gathered([target], modify=True, src=0):
        if rank == 0:
            target.data.fill_(0.5)  # only rank 0 writes: its values reach every shard
    after = engine.state_dict()
    return {"reads_match": reads_match, "released": released,
            "written": rank != 0 or bool((after["blocks.1.fc.weight"] == 0.5).all()),
            "others_kept": rank != 0 or torch.equal(after["blocks.0.fc.weight"], full["blocks.0.fc.weight"])}


def test_gathered_gives_full_parameters_and_writes_back_from_one_rank() -> None:
    for r in run_threads(_gathered, 3):
        assert all(r.values()), r


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(13, 13)
        self.outer = nn.Linear(13, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


class Quirky(nn.Module):
    """Stage 3's awkward cases in one model: a unit called twice per forward, a submodule of a unit
    called on its own, execution order that changes with the input, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 13)
        self.a, self.b, self.c = _Mixer(), _Mixer(), _Mixer()
        self.head = nn.Linear(13, 37)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 13))
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.scale
        x = self.a(self.a(x))  # a unit used twice in one forward
        self.calls += 1  # the order changes every third call, the same way on every rank
        first, second = (self.b, self.c) if self.calls % 3 else (self.c, self.b)
        x = second(first(x))
        x = x + self.c.inner(x)  # a unit's submodule called outside the unit's forward
        return torch.nn.functional.cross_entropy(self.head(x)[:, :-1].reshape(-1, 37), tokens[:, 1:].reshape(-1))


def quirky(seed: int = 0) -> nn.Module:
    with seeded(seed):
        return Quirky()


def _quirky(rank: int, world: int) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    ref = ddp_reference(rank, STEPS, 2, model_fn=quirky, eval_every=3)
    run, _ = engine_run(rank, STEPS, 2, ["zero.stage=3", "zero.wrap=[_Mixer]", "zero.param_persistence_threshold=20",
                                         "zero.prefetch_units=2"], model_fn=quirky, eval_every=3)
    problems = []
    for what, ours, theirs in (("losses", run.losses, ref.losses), ("eval", run.eval_losses, ref.eval_losses)):
        if not torch.allclose(torch.tensor(ours), torch.tensor(theirs), rtol=LOSS_RTOL, atol=0):
            problems.append(f"rank {rank}: {what} {ours[:4]} vs DDP {theirs[:4]}")
    for pname, value in ref.params.items():
        if (run.params[pname] - value).abs().max().item() > PARAM_ATOL:
            problems.append(f"rank {rank}: parameter {pname} differs")
    return problems


def test_stage3_handles_repeated_units_changing_order_loose_submodules_and_buffers() -> None:
    problems = [p for r in run_threads(_quirky, 2) for p in r]
    assert not problems, "\n".join(problems)


class _IndexedPositions(nn.Module):
    """A GPT (untied) whose forward reads the position table by indexing its weight, not by calling the module:
    a use of a split unit's parameter outside that unit's forward."""

    def __init__(self, indexed: bool) -> None:
        super().__init__()
        from zerorun.bench.gpt import GPT, GPTConfig

        self.indexed = indexed
        self.gpt = GPT(GPTConfig(layers=2, d_model=24, heads=2, vocab=37, seq_len=8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        g, inputs, targets = self.gpt, tokens[:, :-1], tokens[:, 1:]
        positions = g.pos.weight[:inputs.shape[1]] if self.indexed else g.pos(torch.arange(inputs.shape[1]))
        x = g.tok(inputs) + positions
        for block in g.blocks:
            x = block(x)
        return torch.nn.functional.cross_entropy(g.head(g.ln_f(x)).reshape(-1, 37), targets.reshape(-1))


def indexed_positions(seed: int = 0, indexed: bool = True) -> nn.Module:
    with seeded(seed):
        return _IndexedPositions(indexed)


def _split(rank: int, world: int, indexed: bool) -> tuple[list[str], list[str], list[str], str]:
    import contextlib
    import io

    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    model_fn = functools.partial(indexed_positions, indexed=indexed)
    ref = ddp_reference(rank, STEPS, 2, model_fn=model_fn, eval_every=3)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run, engine = engine_run(rank, STEPS, 2, BASE, model_fn=model_fn, eval_every=3)
    problems = []
    for what, ours, theirs in (("losses", run.losses, ref.losses), ("eval", run.eval_losses, ref.eval_losses)):
        if not torch.allclose(torch.tensor(ours), torch.tensor(theirs), rtol=LOSS_RTOL, atol=0):
            problems.append(f"rank {rank}: {what} {ours[:4]} vs DDP {theirs[:4]}")
    for pname, value in ref.params.items():
        if _param_diff(pname, run.params[pname], value) > PARAM_ATOL:
            problems.append(f"rank {rank}: parameter {pname} differs")
    split = [g.name for g in engine.store.groups if g.kind is UnitKind.SPLIT]
    return problems, split, engine.store.scheduler.kept_whole, printed.getvalue()


@pytest.mark.parametrize("indexed", [False, True])
def test_modules_outside_every_unit_are_split_off_the_root_unless_used_outside_their_forward(indexed: bool) -> None:
    # the embeddings and the head (untied) are split off the root and gathered around their use; a
    # position table read through its weight stays gathered for the whole pass (released around its own
    # forward, the indexing would read a released parameter), and both train exactly as DDP
    # rank processes: each rank reads what it printed through sys.stdout, which threads would share
    for rank, (problems, split, kept_whole, printed) in enumerate(run_ranks(_split, 3, (indexed,))):
        assert not problems, "\n".join(problems)
        assert split == ["gpt.tok", "gpt.pos", "gpt.head"], split
        assert kept_whole == (["gpt.pos"] if indexed else []), kept_whole
        told = "gpt.pos stays gathered for the whole pass" in printed  # rank 0 says so, once
        assert told == (indexed and rank == 0) and printed.count("stays gathered") <= 1, printed
