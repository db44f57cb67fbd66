"""hpZ (`zero.hpz_partition_size`): stage 3 with a secondary copy within the node trains bit-identically to
plain stage 3, and the gathers after the first of each step stay within the node group."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_threads

STAGE3 = ["zero.stage=3", "train.grad_accum_steps=2"]


def _runs(rank: int, world: int, hpz: int, cpu: str, extra: tuple[str, ...] = ()) -> dict:
    from tests.runtime.reference import engine_run, tied_gpt
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    base = [*STAGE3, f"zero.cpu_collectives={cpu}", *extra]
    plain, plain_engine = engine_run(rank, 4, 2, base, None, model_fn=tied_gpt)
    secondary, engine = engine_run(rank, 4, 2, [*base, f"zero.hpz_partition_size={hpz}"], None, model_fn=tied_gpt)
    return {"losses": (plain.losses, secondary.losses),
            "params": all(torch.equal(plain.params[n], secondary.params[n]) for n in plain.params),
            "world_gathers": (plain_engine.comm.stats.calls["all_gather"], engine.comm.stats.calls["all_gather"]),
            "node_gathers": engine.store.hpz.comm.stats.calls["all_gather"],
            "secondary_bytes": engine.store.hpz.nbytes(), "gathered_numel": sum(u.padded_numel for u in engine.store.units)}


@pytest.mark.parametrize("world, hpz, cpu, extra", [
    pytest.param(4, 2, "gloo", (), marks=pytest.mark.slow), (2, 2, "auto", ()),
    # with qwZ the first gather of a step is int8 across the network and the copy kept is its dequantized values,
    # which are what stage 3 + qwZ's re-gathers deliver again (the same exact shard, quantized the same way)
    pytest.param(2, 2, "gloo", ("zero.quantized_weights=true",), marks=pytest.mark.slow)])
def test_hpz_is_bit_identical_to_stage_3_and_gathers_within_the_node(world: int, hpz: int, cpu: str,
                                                                     extra: tuple[str, ...]) -> None:
    for rank, out in enumerate(run_threads(_runs, world, (hpz, cpu, extra))):
        plain, secondary = out["losses"]
        assert plain == secondary, f"rank {rank}: losses differ"
        assert out["params"], f"rank {rank}: final parameters differ"
        plain_gathers, hpz_gathers = out["world_gathers"]
        # a step gathers every unit from every rank once (its first forward), not three times (two forwards and
        # backwards of the accumulation window: four); the others go to the node group
        assert hpz_gathers < plain_gathers / 2, out["world_gathers"]
        assert out["node_gathers"] > 0
        assert out["secondary_bytes"] == out["gathered_numel"] * 4 / hpz  # fp32: 1/hpz of the model, as estimated


def _refused(rank: int, world: int) -> str:
    import zerorun
    from tests.runtime.reference import make_model
    from zerorun import config
    from zerorun.errors import ZerorunError

    recipe = config.loads("script: t.py\n", "t.yaml", ["zero.stage=3", "zero.hpz_partition_size=2"])
    try:
        zerorun.initialize(make_model(0), None, recipe)
    except ZerorunError as err:
        return str(err)
    return ""


def test_a_partition_size_that_does_not_divide_the_world_is_refused_naming_the_key() -> None:
    for message in run_threads(_refused, 3):
        assert message.startswith("zero.hpz_partition_size: 2 does not divide the world size 3"), message


def test_hpz_outside_stage_3_is_refused() -> None:
    from zerorun import config
    from zerorun.errors import ConfigError

    with pytest.raises(ConfigError, match="zero.hpz_partition_size: the secondary copy is of stage 3"):
        config.loads("script: x\nzero:\n  stage: 2\n  hpz_partition_size: 2\n", "r.yaml")
