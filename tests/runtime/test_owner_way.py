"""The owner way moves what Adam moves, and steps where the device is, whatever holds its state.

Muon's whole matrices travel in the stage's own collectives.

The stage lays an owner-run group out so each rank's piece holds whole parameters (ownership.py), so
the reduce-scatter already brings each matrix's whole gradient to its owner and the all-gather takes
each updated matrix back out, and the pieces' padding never travels (`used`, partition.py). Before,
the owner step gathered every gradient and master and scattered the updates back: 2.5x AdamW's bytes
at stage 2. Here a step with Muon + AdamW moves AdamW's bytes (within a few per call) in as many calls or fewer, at stages
2 and 3, on 2 and 3 ranks (tests/runtime/test_any_optimizer.py proves Muon's values against DDP's).

With the optimizer on the host and a GPU, owned parameters step on the GPU and their state goes back to
the host after each step (`OwnedHost`). A CPU-only machine has no such move (the state stays in the
optimizer), so the test below makes the engine take it on the CPU: the same bits as without it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.harness import run_threads, seeded


class Net(nn.Module):
    """An embedding, matrices of several shapes (Muon's), norms and biases (AdamW's), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 24)
        self.up = nn.Linear(24, 72)
        self.down = nn.Linear(72, 24)
        self.mix = nn.Linear(24, 24, bias=False)
        self.norm = nn.LayerNorm(24)
        self.lm_head = nn.Linear(24, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(self.norm(self.mix(h))).logsumexp(-1).mean()


def _step_traffic(rank: int, world: int, stage: int) -> dict[str, tuple[int, int]]:
    import zerorun
    from zerorun import config

    out = {}
    for kind in ("adamw", "muon"):
        recipe = config.loads("script: t.py", "t.yaml", [f"zero.stage={stage}", f"optimizer.type={kind}",
                                                          "zero.bucket_mb=0.004", "zero.allgather_bucket_mb=0.004",
                                                          "zero.wrap=[Linear]", "zero.param_persistence_threshold=0"])
        with seeded(0):
            model = Net()
        engine = zerorun.initialize(model, None, recipe)
        tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(tokens))
        engine.step()  # the first step sets up what it keeps; the second is what every step costs
        before = {k: (v["calls"], v["bytes"]) for k, v in engine.comm.stats.as_dict().items()}
        engine.backward(engine(tokens))
        engine.step()
        engine.wait_published()
        after = engine.comm.stats.as_dict()
        out[kind] = {k: (v["calls"] - before.get(k, (0, 0))[0], v["bytes"] - before.get(k, (0, 0))[1])
                     for k, v in after.items()}
        out["values"] = {"bytes": (0, 4 * sum(p.numel() for p in model.parameters()))}
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_muon_step_moves_the_bytes_and_calls_an_adamw_step_moves(stage: int, world: int) -> None:
    for rank, traffic in enumerate(run_threads(_step_traffic, world, (stage,))):
        adamw, muon, values = traffic["adamw"], traffic["muon"], traffic["values"]["bytes"][1]
        for kind in ("reduce_scatter", "all_gather"):
            # as many calls or fewer: at stages 1-2 a whole unit is a bucket per rank, so the rank's piece is as large
            assert muon[kind][0] <= adamw[kind][0], (kind, rank, muon, adamw)
            # every value moves once; Adam's flat pieces pad only each unit's end (aligned), the whole pieces not at
            # all, but each piece moves at least one element (never an empty tensor): a few bytes per call
            assert values <= muon[kind][1] <= adamw[kind][1] + 4 * world * muon[kind][0], (kind, rank, muon, adamw)
        assert set(muon) == set(adamw), (muon, adamw)  # no collective of another kind


def _one_way(rank: int, world: int, optimizer: str, stage: int) -> dict:
    """A small untied GPT: its token embedding, position table and head are split units of one matrix each, which
    Muon (DeepSpeed's split) and LAMB run whole, each on one rank: their gathers go one way."""
    import zerorun
    from zerorun import config
    from zerorun.bench.gpt import GPT, GPTConfig
    from zerorun.runtime.stage3.unit_group import UnitKind, UnitState

    recipe = config.loads("script: t.py", "t.yaml", [f"zero.stage={stage}", f"optimizer.type={optimizer}",
                                                      "zero.bucket_mb=0.0005", "zero.allgather_bucket_mb=0.0005",
                                                      "zero.wrap=[Block]", "zero.param_persistence_threshold=0"])
    with seeded(0):
        model = GPT(GPTConfig(layers=2, d_model=24, heads=2, vocab=37, seq_len=8))
    engine = zerorun.initialize(model, None, recipe)
    out: dict = {"losses": []}
    groups = engine.store.groups if stage == 3 else []
    for step in range(4):
        tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(tokens)
        if step == 3:  # after a forward with grad: what stays gathered for the backward
            out["held"] = sorted(g.name for g in groups if g.kind is UnitKind.SPLIT and g.state is UnitState.GATHERED)
            out["one_sided"] = sorted(g.name for g in groups if g.one_sided)
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    engine.destroy()
    return out


@pytest.mark.parametrize("optimizer", ["muon", "lamb", "adamw"])
def test_a_split_unit_gathered_one_way_stays_gathered_for_its_backward_and_trains_as_stage_2(optimizer: str) -> None:
    # gathered again for the backward, an embedding run whole by Muon would cross the link once more, one way,
    # from its owner (docs/optimizers.md); held from its forward instead, it trains exactly as before: as stage 2
    one_way = {"muon": ["head", "pos", "tok"], "lamb": ["head", "pos", "tok"], "adamw": []}[optimizer]
    for three, two in zip(run_threads(_one_way, 2, (optimizer, 3)), run_threads(_one_way, 2, (optimizer, 2))):
        assert three["one_sided"] == one_way, three["one_sided"]
        assert three["held"] == sorted({"head", *one_way}), three["held"]  # the head ends the forward: held anyway
        gap = max(abs(a - b) / abs(b) for a, b in zip(three["losses"], two["losses"]))
        assert gap <= 1e-4, (three["losses"], two["losses"])  # Muon's bf16 Newton-Schulz: the bound


def _units_ahead(rank: int, world: int, optimizer: str, prefetch: list[str]) -> int:
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py", "t.yaml", ["zero.stage=3", f"optimizer.type={optimizer}",
                                                      "zero.wrap=[Linear]", *prefetch])
    with seeded(0):
        model = Net()
    engine = zerorun.initialize(model, None, recipe)
    try:
        return engine.passes.scheduler.prefetch
    finally:
        engine.destroy()


@pytest.mark.parametrize(("optimizer", "prefetch", "ahead"), [("muon", [], 2), ("adamw", [], 1),
                                                               ("muon", ["zero.prefetch_units=1"], 1),
                                                               ("adamw", ["zero.prefetch_units=3"], 3)])
def test_stage3_gathers_two_units_ahead_where_whole_matrices_make_the_gathers_uneven(capfd, optimizer, prefetch,
                                                                                      ahead) -> None:
    """zero.prefetch_units: auto (the default) is 2 where a group runs on whole parameters: a unit's pieces are
    uneven there, and with one gather in flight a link idles one way (docs/optimizers.md measures it); 1 for flat,
    even pieces. A count in the recipe is kept as written."""
    assert run_threads(_units_ahead, 2, (optimizer, prefetch)) == [ahead] * 2
    said = capfd.readouterr().out.count("zerorun: stage 3: 2 units gathered ahead (zero.prefetch_units: auto)")
    assert said == (1 if not prefetch and ahead == 2 else 0)  # rank 0 says so once, and only for auto


def _offloaded_run(rank: int, world: int, stage: int) -> tuple[list[float], list[list[float]], dict]:
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py", "t.yaml", [f"zero.stage={stage}", "optimizer.type=muon",
                                                      "zero.offload_optimizer.device=cpu", "zero.wrap=[Linear]",
                                                      "zero.bucket_mb=0.004", "zero.allgather_bucket_mb=0.004"])
    with seeded(0):
        model = Net()
    engine = zerorun.initialize(model, None, recipe)
    losses = []
    for step in range(4):
        tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with engine.gathered():
        params = [p.detach().flatten().tolist() for p in engine.module.parameters()]
    memory = engine.memory().as_dict()
    engine.destroy()
    return losses, params, memory


@pytest.mark.parametrize("stage", [2, 3])
def test_state_kept_on_the_host_between_device_steps_gives_the_same_bits(stage: int, monkeypatch) -> None:
    from zerorun.runtime.offload.placement import Place
    from zerorun.runtime.optim import owner_step, update

    in_optimizer = run_threads(_offloaded_run, 2, (stage,))
    monkeypatch.setattr(update, "_owned_home", lambda placement, device:
                        owner_step.OwnedHost() if placement.optimizer is Place.HOST else None)
    moved = run_threads(_offloaded_run, 2, (stage,))
    for rank, ((losses, params, _), (moved_losses, moved_params, memory)) in enumerate(zip(in_optimizer, moved)):
        assert moved_losses == losses and moved_params == params, rank
        assert memory["optimizer"]["cpu"] > 0, memory  # Muon's momentum, kept on the host


def test_a_home_lends_its_memory_only_where_a_range_lies_in_one_tensor_on_the_step_device() -> None:
    from zerorun.runtime.offload.homes import MASTER, MemoryHome

    home = MemoryHome.split([10], [4], torch.device("cpu"), torch.device("cpu"))  # two segments: 0..4, 4..10
    home.write(0, MASTER, torch.arange(10.0))
    window = home.window(0, MASTER, 5, 3, torch.device("cpu"))
    assert window is not None and window.tolist() == [5.0, 6.0, 7.0]
    window.add_(100)  # the home's own memory: a step there needs no write back
    assert home.state(0, MASTER)[5:8].tolist() == [105.0, 106.0, 107.0]
    assert home.window(0, MASTER, 2, 4, torch.device("cpu")) is None  # crosses the two segments
    assert home.window(0, MASTER, 5, 3, torch.device("meta")) is None  # another device: read and written instead


@pytest.mark.parametrize("stage", [2, 3])
def test_stepping_the_master_in_the_homes_memory_gives_the_bits_of_stepping_a_copy(stage: int, monkeypatch) -> None:
    from zerorun.runtime.offload import homes

    in_place = run_threads(_offloaded_run, 2, (stage,))
    monkeypatch.setattr(homes.MemoryHome, "window", lambda self, *args: None)  # read out and written back, as before
    copied = run_threads(_offloaded_run, 2, (stage,))
    for rank, ((losses, params, _), (copied_losses, copied_params, _)) in enumerate(zip(in_place, copied)):
        assert losses == copied_losses and params == copied_params, rank


@pytest.mark.parametrize("optimizer, device, home", [("cpu", "cuda", "OwnedHost"), ("cpu", "cpu", None),
                                                     ("device", "cuda", None), ("nvme", "cuda", "OwnedFiles"),
                                                     ("nvme", "cpu", "OwnedFiles")])
def test_the_owner_ways_state_lives_where_the_recipe_puts_the_optimizer(tmp_path, optimizer, device, home) -> None:
    """On a GPU with the optimizer on the host, the owned parameters step on the GPU and keep their state on the
    host (`OwnedHost`); on a CPU the optimizer's own state is already there. NVMe: files, on any device."""
    from types import SimpleNamespace

    from zerorun.runtime.offload.placement import Place
    from zerorun.runtime.optim.update import _owned_home

    placement = SimpleNamespace(optimizer=Place(optimizer), optimizer_nvme=str(tmp_path), run="job", rank=1)
    chosen = _owned_home(placement, torch.device(device))  # type: ignore[arg-type]
    assert (type(chosen).__name__ if chosen is not None else None) == home
    if home == "OwnedFiles":
        assert chosen.root.parent == tmp_path / "job" / "rank-1"
