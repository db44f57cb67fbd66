"""Ranks that reach different collectives are stopped before any data moves, on every rank, with one message
naming where each was; the habits that cause it (evaluation or a state dict on one rank at stage 3, a skipped
backward, an extra step, another accumulation count, a data loader that runs out early on one rank) are each
named, and what can be made to work exactly works (a gathered evaluation on rank 0, every rank's
`model.state_dict()`).

Each case runs on fresh engines in one set of rank processes; after a mismatch the ranks go on with the next case
(on a fresh shared-memory segment: the one that stopped refuses further work, as it should).
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from zerorun.runtime.comm.places import Activity, DesyncError, Place, Tag, UnitNames, check_agree, mismatch_message
from zerorun.runtime.comm.tags import fingerprint
from zerorun.runtime.comm.wire import Op
from zerorun.runtime.engine_place import unit_name

STEPS, ACCUM = 3, 2


# -- the tag itself (no ranks) -------------------------------------------------------------------------
def _tag(**change: object) -> Tag:
    fields: dict = dict(seq=7, op=Op.ALL_GATHER, numel=1234, unit=2, place=Place(Activity.FORWARD, 3, 6, 0))
    fields.update(change)
    return Tag(**fields)


def test_a_tag_survives_its_words_and_every_field_changes_its_fingerprint() -> None:
    tag = _tag(detail=1)
    assert Tag.from_words(tag.words()) == tag
    assert Tag.from_words([0] * 8) is None  # a slot nothing was written to
    variants = [_tag(seq=8), _tag(op=Op.REDUCE_SCATTER), _tag(numel=1235), _tag(unit=3), _tag(detail=1),
                _tag(place=Place(Activity.NO_GRAD_FORWARD, 3, 6, 0)), _tag(place=Place(Activity.FORWARD, 4, 6, 0)),
                _tag(place=Place(Activity.FORWARD, 3, 7, 0)), _tag(place=Place(Activity.FORWARD, 3, 6, 1))]
    prints = {fingerprint(v) for v in variants}
    assert len(prints) == len(variants) and fingerprint(_tag()) not in prints
    assert all(0 <= p < 2**62 for p in prints)  # its negation fits int64 (the wire takes max of both)


def test_agreeing_tags_pass_and_differing_ones_name_every_rank_and_the_habit() -> None:
    names = UnitNames(["embed", "blocks.0", "blocks.1"])
    check_agree([_tag(), _tag(), _tag()], names)
    evaluation = _tag(place=Place(Activity.NO_GRAD_FORWARD, 3, 6, 0))
    with pytest.raises(DesyncError) as stopped:
        check_agree([evaluation, _tag(), None], names)
    text = str(stopped.value)
    assert "rank 0: step 3, micro-step 6, a forward outside a training step (no_grad, not in engine.backward)" in text
    assert "rank 1: step 3, micro-step 6, forward, all-gather of unit blocks.1 (1,234 elements" in text
    assert "rank 2: not at this collective" in text
    assert "with engine.gathered(): if rank == 0: evaluate(model)" in text
    end = Tag(9, Op.ALL_REDUCE, 0, -1, Place(Activity.SCRIPT_END, 3, 6, 0))
    assert "data loader that ran out early" in mismatch_message([_tag(), end], names)
    state = _tag(place=Place(Activity.STATE_DICT, 3, 6, 0))
    assert "Call them on every rank and save on rank 0" in mismatch_message([state, _tag()], names)
    ahead = _tag(place=Place(Activity.FORWARD, 3, 7, 0))
    assert "engine.step() or engine.backward() was called a different number" in mismatch_message([_tag(), ahead],
                                                                                                     names)
    skipped = _tag(place=Place(Activity.STEP, 3, 6, 1)), _tag(place=Place(Activity.STEP, 3, 6, 2))
    assert "a skipped batch or backward" in mismatch_message(list(skipped), names)


def test_a_unit_is_named_by_the_module_that_holds_its_parameters() -> None:
    assert unit_name(["blocks.2.attn.qkv.weight", "blocks.2.attn.qkv.bias", "blocks.2.mlp.fc.weight"]) == "blocks.2"
    assert unit_name(["embed.weight"]) == "embed"
    assert unit_name(["scale"]) == "scale"
    assert unit_name(["embed.weight", "norm.weight", "head.bias"]) == "embed.weight + 2 more"


# -- in rank processes ------------------------------------------------------------------------------------
def _engine(stage: int, overrides: tuple[str, ...], accum: int = ACCUM):
    import zerorun
    from tests.runtime.reference import OPT, make_model
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [f"zero.stage={stage}", f"train.grad_accum_steps={accum}",
                                                        "zero.bucket_mb=0.0005", *overrides])
    model = make_model(0)
    return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), **OPT), recipe)


def _micro(engine, rank: int, micro: int, backward: bool = True) -> float:
    from tests.runtime.reference import batch

    loss = engine(batch(0, rank, micro))
    if backward:
        engine.backward(loss)
    engine.step()
    return loss.item()


def _train(engine, rank: int, micros: range, odd=None) -> list[float]:
    """Micro-steps in `micros`; `odd(engine, micro)` (on the rank that misbehaves) replaces one of them."""
    losses = []
    for micro in micros:
        if odd is not None and odd(engine, micro):
            continue
        losses.append(_micro(engine, rank, micro))
    return losses


def _evaluate(engine, rank: int) -> float:
    from tests.runtime.reference import batch

    with torch.no_grad():
        return float(engine(batch(99, rank, 0)))


# Each case: (what rank 0 does differently, at which micro-step) -> what every rank's error must say
def _eval_alone(engine, micro: int) -> bool:
    if micro == 2:
        _evaluate(engine, 0)
    return False


def _state_dict_alone(engine, micro: int) -> bool:
    if micro == 2:
        engine.module.state_dict()
    return False


def _skip_backward(engine, micro: int) -> bool:
    if micro == 2:  # the window's first (a window's last without a backward is refused on the rank itself)
        _micro(engine, 0, micro, backward=False)
        return True
    return False


def _extra_step(engine, micro: int) -> bool:
    if micro == 2:
        engine.step()
    return False


def _loader_ran_out(engine, micro: int) -> bool:
    if micro == 2:
        engine.comm.end_of_script()  # what the worker does once rank 0's script returned
    return False


CASES = {
    "eval alone": (_eval_alone, "a forward outside a training step", "with engine.gathered(): if rank == 0:"),
    "state dict alone": (_state_dict_alone, "a state dict (engine.state_dict(), model.state_dict() or the optimizer's)",
                         "Call them on every rank and save on rank 0"),
    "skipped backward": (_skip_backward, "rank 0:", "called a different number of times"),
    "extra step": (_extra_step, "rank 0: step 1, micro-step 3", "called a different number of times"),
    "loader ran out": (_loader_ran_out, "the end of the script", "a data loader that ran out early"),
}


def _fresh_transport() -> None:
    """After a mismatch the shared-memory segment refuses further work (as it must): a new one for the next case."""
    from zerorun.runtime import context
    from zerorun.runtime.comm.shm_collectives import Segments

    context.current().part(Segments).close()


def _cases(rank: int, world: int, stage: int, overrides: tuple[str, ...], names: list[str], standin: str) -> dict:
    import contextlib

    from tests.runtime.cuda_standin import pretend_cuda
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    out = {}
    for name in names:
        odd, *_ = CASES[name]
        with pretend_cuda(standin) if standin else contextlib.nullcontext():
            engine = _engine(stage, overrides)
            try:
                out[name] = ("trained", _train(engine, rank, range(STEPS * ACCUM), odd if rank == 0 else None))
            except DesyncError as stopped:
                out[name] = ("stopped", str(stopped))
                engine.interop.remove()  # an engine that stopped is done: nothing of it is settled at the end
        _fresh_transport()
    return out


def _check_stopped(results: list[dict], names: list[str]) -> None:
    for name in names:
        _, where, advice = CASES[name]
        outcomes = [result[name] for result in results]
        assert all(kind == "stopped" for kind, _ in outcomes), f"{name}: {outcomes}"
        messages = {text for _, text in outcomes}
        assert len(messages) == 1, f"{name}: every rank must print the same message: {messages}"
        text = messages.pop()
        assert where in text and advice in text, f"{name}: {text}"
        assert all(f"rank {r}:" in text for r in range(len(results))), text


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_rank_zero_evaluating_or_saving_alone_at_stage_3_stops_every_rank_at_its_first_collective(transport) -> None:
    names = ["eval alone", "state dict alone"]
    _check_stopped(run_ranks(_cases, 2, (3, (f"zero.cpu_collectives={transport}",), names, "")), names)


def test_every_desync_is_named_on_three_ranks_at_every_stage_before_it_trains() -> None:
    names = ["skipped backward", "extra step", "loader ran out"]
    for stage in (1, 2, 3):
        results = run_ranks(_cases, 3, (stage, (), names + (["eval alone"] if stage == 3 else []), ""))
        _check_stopped(results, names + (["eval alone"] if stage == 3 else []))


@pytest.mark.slow
@pytest.mark.parametrize("world,stage,overrides,standin", [
    (2, 2, ("precision=bf16",), ""), (3, 3, ("precision=bf16", "zero.cpu_collectives=gloo"), ""),
    (2, 3, (), "nccl"), (2, 2, (), "nccl"), (2, 3, ("zero.offload_optimizer=cpu",), ""),
])
def test_the_desyncs_are_named_in_bf16_offloaded_and_on_the_nccl_wire(world, stage, overrides, standin) -> None:
    names = list(CASES) if stage == 3 else ["skipped backward", "extra step", "loader ran out"]
    _check_stopped(run_ranks(_cases, world, (stage, overrides, names, standin)), names)


# -- what works instead -----------------------------------------------------------------------------
def _gathered_evaluation(rank: int, world: int, stage: int, evaluate: bool) -> dict:
    """Train; rank 0 evaluates alone between steps inside `engine.gathered()` (stage 3) or bare (stages 1-2, which
    hold whole parameters); and every rank's `model.state_dict()` at the end."""
    engine = _engine(stage, ())
    losses, evals = [], []
    for step in range(STEPS):
        losses += _train(engine, rank, range(step * ACCUM, (step + 1) * ACCUM))
        if evaluate:
            with engine.gathered() if stage == 3 else torch.no_grad():
                if rank == 0:
                    evals.append(_evaluate(engine, rank))
    mine = {k: v.float().tolist() for k, v in engine.module.state_dict().items()}  # plain values cross processes
    return {"losses": losses, "evals": evals, "state": mine,
            "engine": {k: v.float().tolist() for k, v in engine.state_dict().items()}}


@pytest.mark.parametrize("stage", [2, 3])
def test_rank_zero_evaluates_alone_inside_gathered_and_training_is_unchanged(stage: int) -> None:
    alone = run_ranks(_gathered_evaluation, 2, (stage, True))
    reference = run_ranks(_gathered_evaluation, 2, (stage, False))
    assert len(alone[0]["evals"]) == STEPS and alone[1]["evals"] == []
    assert [r["losses"] for r in alone] == [r["losses"] for r in reference]  # the very bits
    full = alone[0]["engine"]  # engine.state_dict(): rank 0 holds the whole model (stage 3: {} elsewhere)
    for result in alone:  # model.state_dict() on every rank: whole parameters, the masters engine.state_dict() has
        assert result["state"] == full
