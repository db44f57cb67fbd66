"""Stage 3's plan and each unit group's state machine: who goes where, strict transitions that refuse
wrong orders, and the forgiving helpers that accept every legitimate state; both stores implement `ParamStore`."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_threads, seeded
from tests.runtime.reference import OPT, VOCAB, ddp_reference, engine_run, tied_gpt
from zerorun.runtime.stage3.module_units import plan_stage3
from zerorun.runtime.stage3.unit_group import UnitKind, UnitState


def _plan(threshold: int, world: int = 2):
    model = tied_gpt(0)
    groups = [[p for p in model.parameters() if p.requires_grad]]
    return model, plan_stage3(model, groups, ["Block"], threshold, auto_numel=10**9, chunk_numel=500, world=world,
                              dtype=torch.float32)


def test_the_plan_puts_blocks_in_units_shared_weights_in_the_root_and_small_ones_in_the_persistent_set() -> None:
    model, plan = _plan(threshold=30)
    assert [group.name for group in plan.gathered_units()] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [plan.root.kind, plan.persistent.kind] == [UnitKind.ROOT, UnitKind.PERSISTENT]
    assert plan.groups[-2:] == [plan.root, plan.persistent]
    assert model.tok.weight in plan.root.params  # tied to the head: shared, so the root's
    assert all(p.numel() < 30 for p in plan.persistent.params) and plan.persistent.params
    assert all(u.layout.numel <= 500 or len(u.params) == 1 for u in plan.units)
    first = plan.groups[0]
    assert [plan.group_of[k] for k in first.slots] == [first] * len(first.units) and first.units
    assert [plan.units[k] for k in first.slots] == first.units
    everything = [p for u in plan.units for p in u.params]
    assert len(everything) == len(set(everything)) == len([p for p in model.parameters() if p.requires_grad])
    assert sum(u.shard_numel for u in plan.units) == plan.group_numels[0]


def _transitions(rank: int, world: int) -> dict:
    from zerorun import config
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed
    from zerorun.runtime.offload.placement import Placement
    from zerorun.runtime.precision import PrecisionPolicy
    from zerorun.runtime.stage3.sharded_params import ShardedParams

    info = init_distributed()
    model, plan = _plan(threshold=30, world=world)
    weight = model.blocks[0].fc.weight
    original = weight.detach().clone()
    recipe = config.loads("script: t.py", "t.yaml", ["zero.stage=3"])
    store = ShardedParams(model, plan, Placement.from_recipe(recipe, info.device, rank), PrecisionPolicy(), Collectives())
    from zerorun.runtime.flat_params import FlatParams
    from zerorun.runtime.offload.homes import Home
    from zerorun.runtime.store import ParamStore

    flat = FlatParams([list(tied_gpt(1).parameters())], Placement.from_recipe(recipe, info.device, rank),
                      PrecisionPolicy(), Collectives(), world, 100)
    block = plan.groups[0]
    out = {"protocols": all(isinstance(s, ParamStore) and isinstance(s.home, Home) for s in (store, flat)),
           "released_is_empty": weight.numel() == 0 and block.state is UnitState.RELEASED,
           "persistent_gathered": plan.persistent.state is UnitState.GATHERED}
    refused = []
    for wrong in (block.finish_gather, block.release):
        try:
            wrong()
        except AssertionError as exc:
            refused.append(str(exc))
    block.start_gather()
    try:
        block.start_gather()
    except AssertionError as exc:
        refused.append(str(exc))
    block.finish_gather()
    out["gathered_values"] = torch.equal(weight.detach(), original)
    out["refused"] = refused
    block.release()
    block.prefetch()
    out["prefetch_starts"] = block.state is UnitState.GATHERING
    block.prefetch()
    block.ensure_gathered()
    block.ensure_gathered()
    out["ensure_finishes"] = block.state is UnitState.GATHERED
    block.release_if_held()
    block.release_if_held()
    out["release_if_held"] = block.state is UnitState.RELEASED and weight.numel() == 0
    return out


def test_transitions_assert_their_starting_state_and_the_helpers_forgive() -> None:
    out = run_threads(_transitions, 2)[0]
    refused = out.pop("refused")
    assert all(out.values()), out
    assert refused == ["stage 3 unit blocks.0: expected gathering, but it is released",
                       "stage 3 unit blocks.0: expected gathered, but it is released",
                       "stage 3 unit blocks.0: expected released, but it is gathering"], refused


class _EncoderModel(torch.nn.Module):
    """An nn.TransformerEncoder inside a language model, as its users write it: the encoder's layers sit in a
    ModuleList inside it. Returns the next-token loss, as the reference harness expects."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.encoder(self.embed(tokens[:, :-1])))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _encoder_model(seed: int) -> _EncoderModel:
    with seeded(seed):
        return _EncoderModel()


def test_automatic_units_descend_into_a_transformer_encoder_to_its_layers() -> None:
    """zero.wrap: [] made the whole nn.TransformerEncoder one unit (gathered whole: no memory saved); its
    repeated layers are the units now, as `wrap: [TransformerEncoderLayer]` would make them."""
    model = _encoder_model(0)
    groups = [[p for p in model.parameters() if p.requires_grad]]
    plan = plan_stage3(model, groups, [], 0, auto_numel=100, chunk_numel=10**6, world=2, dtype=torch.float32)
    names = [g.name for g in plan.gathered_units() if g.kind is UnitKind.WRAPPED]
    assert names == ["embed", "encoder.layers.0", "encoder.layers.1", "encoder.layers.2", "head"], names


def _encoder_parity(rank: int, world: int) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    ref = ddp_reference(rank, 6, 2, model_fn=_encoder_model)
    run, engine = engine_run(rank, 6, 2, ["zero.stage=3", "zero.wrap=[]", "zero.param_persistence_threshold=0"],
                             model_fn=_encoder_model)
    problems = [] if len(engine.store.plan.gathered_units()) >= 3 else ["the encoder's layers are no units"]
    if not torch.allclose(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=1e-5, atol=0):
        problems.append(f"losses {run.losses[:3]} vs DDP {ref.losses[:3]}")
    for name, value in ref.params.items():
        diff = (run.params[name] - value).abs()
        if name.endswith("in_proj_bias"):
            # The key part's true gradient is exactly zero (softmax ignores a constant shift of the scores): its
            # gradient is rounding noise, which Adam turns into steps of up to ~lr each, in either direction. So
            # only the query and value parts are compared; the key part just stays within 6 steps x lr of DDP's.
            d = diff.numel() // 3
            if diff[d:2 * d].max() > 6 * OPT["lr"]:
                problems.append(f"{name}: key bias moved {diff[d:2 * d].max():.2e} from DDP's")
            diff = torch.cat([diff[:d], diff[2 * d:]])
        if diff.max() > 5e-7:
            problems.append(f"{name} differs by {diff.max():.2e}")
    return problems


@pytest.mark.slow
def test_stage3_with_automatic_units_in_a_transformer_encoder_trains_as_ddp() -> None:
    problems = [p for rank_problems in run_threads(_encoder_parity, 3) for p in rank_problems]
    assert not problems, problems
