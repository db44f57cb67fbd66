"""torch.compile before `zerorun.initialize`, at every stage: eager's losses, and the graph breaks that must exist.

A script compiles the whole model (`torch.compile(model)`) or each block (`block.compile()`, or
`model.blocks[i] = torch.compile(block)`) and hands it to `zerorun.initialize`. Each compiled run here
is compared with the same engine run eagerly, loss by loss.

The tolerance is the one torch's own compile gives DDP
-------------------------------------------------------
Compiling changes the order of floating-point operations (inductor fuses and reorders), so a compiled
run is not bit-identical to an eager one, under DDP as under zerorun. How far torch's own compile
moves DDP + torch AdamW: `test_torch_compile_moves_ddp_losses_within_the_tolerance` trains the
reference GPT of tests/runtime/reference.py (`tied_gpt`: 3 blocks, d_model 24, tied embedding) with
DDP for STEPS optimizer steps of ACCUM micro-batches, eagerly, compiled whole (`torch.compile(DDP(m))`)
and compiled per block, and takes the largest relative difference of the 16 losses. Measured on 2 ranks
(torch 2.13 CPU; 3 ranks in fp32: 1.3e-7): fp32 2.0e-7; bf16 3.5e-4; fp16 1.4e-4 (zerorun's
low-precision policy: compute in the format, fp32 master, reference.py). The tolerance is 4x that,
rounded up, as test_engine_parity.py allows ~4x DDP's own deviation: TOLERANCE below. It stays under
the format's unit roundoff (bf16 2^-8, fp16 2^-11 relative: a loss in the compute format is defined
only to that, test_engine_precision.py). That test also keeps the tolerance honest both ways: torch's
own compile must stay within it, and a reference that skips one optimizer step (it moved the losses
by 2.4e-3 to 2.8e-3 in every format) must not.

The runs that pass must have compiled: each compiled run counts dynamo's graphs (bench/compiling.py),
and the graph breaks and frames left eager are checked against the ones that must exist
(docs/profiling-and-compiling.md): none at stages 0-2 or with per-block compile; at stage 3 with
`torch.compile(model)`, the root's forward, which holds every unit's gather and release.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.reference import compiled, ddp_reference, engine_run, inductor_in_turn, tied_gpt

STEPS, ACCUM = 8, 2
TOLERANCE = {"fp32": 8e-7, "bf16": 1.4e-3, "fp16": 6e-4}  # relative, per loss: see the module docstring
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_SCALE = {"fp32": 1.0, "bf16": 1.0, "fp16": 1024.0}  # fp16: a static scale, as test_engine_precision.py
# default buckets, a unit per Block: the units a user of this model gets (engine_run's tiny ones cut everything)
BLOCK_UNITS = ["zero.wrap=[Block]", "zero.bucket_mb=25", "zero.allgather_bucket_mb=25"]


def gpt(seed: int, compile: str = "none", checkpoint: str = "none", layers: str = "") -> torch.nn.Module:
    """The reference GPT, compiled as a script would; `layers="fullgraph"`: each block replaced by
    `torch.compile(block, fullgraph=True)`, torchtitan's way."""
    model = compiled(tied_gpt(seed, checkpoint), compile)
    if layers == "fullgraph":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, fullgraph=True, backend=inductor_in_turn)
    return model


def worst(losses: list[float], reference: list[float]) -> float:
    ours, theirs = torch.tensor(losses, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    assert ours.shape == theirs.shape, f"{len(losses)} losses against {len(reference)}"
    return ((ours - theirs).abs() / theirs.abs()).max().item()


def _engine(rank: int, overrides: list[str], dtype: str = "fp32", **model: str) -> tuple[list[float], object]:
    """The engine's losses with `gpt(**model)`, and what dynamo did for them (counted from a reset)."""
    from zerorun.bench import compiling

    compiling.reset()
    scale = [f"precision.dtype={dtype}", f"precision.initial_loss_scale={LOSS_SCALE[dtype]}"]
    run, _ = engine_run(rank, STEPS, ACCUM, [*overrides, *scale], model_fn=functools.partial(gpt, **model))
    return run.losses, compiling.counts()


# -- the tolerance ------------------------------------------------------------------------------------
def _torch_own(rank: int, world: int, dtypes: list[str]) -> dict[str, dict[str, float]]:
    """Per dtype, how far DDP's losses move when compiled whole and per block, and with a step skipped."""
    from zerorun.bench import compiling
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    moved: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        reference = functools.partial(ddp_reference, rank, STEPS, ACCUM, dtype=DTYPES[dtype],
                                      loss_scale=LOSS_SCALE[dtype], model_fn=tied_gpt)
        eager = reference().losses
        moved[dtype] = {"skipped step": worst(reference(mistake="skip-step-5").losses, eager)}
        for mode in ("whole", "block"):
            compiling.reset()
            moved[dtype][mode] = worst(reference(compile=mode).losses, eager)
            assert compiling.counts().graphs > 0, f"DDP {dtype} {mode}: nothing was compiled"
    return moved


@pytest.fixture(scope="module")
def torch_own() -> list[dict[str, dict[str, float]]]:
    """Every dtype measured in one pair of rank processes: inductor's start (its import, its compile workers, the
    first C++ build) is paid once rather than per dtype (117.5 s of CPU against 145 for three pairs, cold cache)."""
    return run_ranks(_torch_own, 2, (list(TOLERANCE),), timeout=1500)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_torch_compile_moves_ddp_losses_within_the_tolerance(torch_own: list[dict[str, dict[str, float]]],
                                                              dtype: str) -> None:
    moved = [by_dtype[dtype] for by_dtype in torch_own]
    for rank, by_mode in enumerate(moved):
        for mode in ("whole", "block"):
            assert by_mode[mode] <= TOLERANCE[dtype], (
                f"rank {rank}: torch's own compile ({mode}) moves DDP's {dtype} losses by {by_mode[mode]:.2e}, over "
                f"the tolerance {TOLERANCE[dtype]:.1e}: measure it again and say so in the module docstring")
        assert by_mode["skipped step"] > TOLERANCE[dtype], f"rank {rank}: a skipped step hides in {by_mode}"


# -- every stage, whole model and per block ----------------------------------------------------------
def _every_stage(rank: int, world: int) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    problems = []
    for stage in (0, 1, 2, 3):
        overrides = [f"zero.stage={stage}", *BLOCK_UNITS]
        eager, _ = _engine(rank, overrides)
        for mode in ("whole", "block"):
            losses, counts = _engine(rank, overrides, compile=mode)
            name = f"stage {stage}, compiled {mode}, {world} ranks, rank {rank}"
            if worst(losses, eager) > TOLERANCE["fp32"]:
                problems.append(f"{name}: losses {worst(losses, eager):.2e} from eager's")
            # the breaks that must exist: stage 3 gathers and releases each unit in a hook, which a whole-model
            # compile holds inside the root's forward (dynamo leaves that frame eager and compiles each unit)
            must = (0, 1) if stage == 3 and mode == "whole" else (0, 0)
            if counts.graphs == 0 or (counts.graph_breaks, counts.eager_frames) != must:
                problems.append(f"{name}: {counts.describe()} (must be >= 1 graph, {must[0]} breaks, {must[1]} "
                                f"frames left eager): {counts.reasons}")
    return problems


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_compiled_models_train_to_eager_losses_at_every_stage(world: int) -> None:
    problems = run_ranks(_every_stage, world, timeout=1500)
    assert problems == [[]] * world, "\n".join(p for rank in problems for p in rank)


# -- activation checkpointing, offload, bf16/fp16, fullgraph blocks ---------------------------------
COMBINATIONS = [  # (recipe overrides, dtype, gpt(...) keywords)
    (["zero.stage=3"], "fp32", {"compile": "block", "checkpoint": "non-reentrant"}),  # tiny buckets: split units too
    (["zero.stage=3"], "fp32", {"compile": "whole", "checkpoint": "reentrant"}),
    (["zero.stage=2"], "fp32", {"compile": "whole", "checkpoint": "non-reentrant"}),
    (["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu"], "fp32", {"compile": "whole"}),
    (["zero.stage=2", "zero.offload_optimizer=cpu", "zero.overlap_publish=true"], "fp32", {"compile": "block"}),
    (["zero.stage=3"], "bf16", {"compile": "block"}),
    (["zero.stage=2"], "bf16", {"compile": "whole"}),
    (["zero.stage=3"], "fp16", {"compile": "whole"}),
    (["zero.stage=3", *BLOCK_UNITS], "fp32", {"layers": "fullgraph"}),
]


def _combinations(rank: int, world: int) -> list[str]:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    problems = []
    for overrides, dtype, model in COMBINATIONS:
        eager, _ = _engine(rank, overrides, dtype, checkpoint=model.get("checkpoint", "none"))
        losses, counts = _engine(rank, overrides, dtype, **model)
        if worst(losses, eager) > TOLERANCE[dtype]:
            problems.append(f"{overrides} {dtype} {model}, rank {rank}: losses {worst(losses, eager):.2e} from eager's "
                            f"(tolerance {TOLERANCE[dtype]:.1e}); {counts.describe()}")
    return problems


@pytest.mark.slow
def test_compiled_models_train_to_eager_losses_with_checkpointing_offload_and_low_precision() -> None:
    problems = run_ranks(_combinations, 2, timeout=1500)
    assert problems == [[], []], "\n".join(p for rank in problems for p in rank)


# -- what cannot work is refused at initialize ---------------------------------------------------------
def _initialize(rank: int, world: int, overrides: list[str], fullgraph: bool) -> str:
    import zerorun
    from zerorun import config
    from zerorun.errors import ZerorunError

    recipe = config.loads("script: t.py\n", "t.yaml", overrides)
    try:
        zerorun.initialize(torch.compile(tied_gpt(0), fullgraph=fullgraph), None, recipe)  # compiles nothing yet
    except ZerorunError as exc:
        return str(exc)
    return "initialized"


def test_stage3_refuses_a_whole_model_fullgraph_compile_at_initialize_and_stage2_takes_it() -> None:
    refused = run_ranks(_initialize, 2, (["zero.stage=3", *BLOCK_UNITS], True))
    assert all("ZeRO stage 3 with torch.compile(model, fullgraph=True)" in message and "_orig_mod.blocks.0" in message
               and "torch.compile(block, fullgraph=True)" in message for message in refused), refused
    assert run_ranks(_initialize, 2, (["zero.stage=2"], True)) == ["initialized"] * 2


def _compile_after_initialize(rank: int, world: int) -> str:
    import zerorun
    from tests.runtime.reference import batch
    from zerorun import config
    from zerorun.errors import ZerorunError
    from zerorun.runtime import compiled

    model = tied_gpt(0)
    loaded, compiled.dynamo_loaded = compiled.dynamo_loaded, lambda: False  # a process that has not loaded dynamo
    try:  # (the test ranks' server imports it for every rank: tests/harness.py)
        engine = zerorun.initialize(model, None, config.loads("script: t.py\n", "t.yaml", ["zero.stage=3",
                                                                                             *BLOCK_UNITS]))
    finally:
        compiled.dynamo_loaded = loaded
    model.blocks[0].compile()  # the first use of torch.compile in this process
    try:
        engine(batch(0, rank, 0))
    except ZerorunError as exc:
        return str(exc)
    return "ran"


@pytest.mark.slow  # the development tier keeps the refusals made at initialize
def test_a_model_compiled_after_initialize_is_refused_at_its_first_forward() -> None:
    """Before a backward could crash: zerorun marks its hooks at initialize, and dynamo was not loaded then."""
    said = run_ranks(_compile_after_initialize, 2)
    assert all("compiled after zerorun.initialize (blocks.0 compiled)" in s for s in said), said


def test_what_the_script_compiled_is_read_without_compiling_anything() -> None:
    from zerorun.runtime import compiled as compiled_model

    assert compiled_model.inspect(tied_gpt(0)) == compiled_model.CompiledModel()
    whole = compiled_model.inspect(torch.compile(tied_gpt(0), fullgraph=True))
    assert whole.whole and whole.fullgraph == [""] and whole.parts == []
    per_block = compiled_model.inspect(gpt(0, compile="block"))
    assert not per_block.whole and per_block.parts == ["blocks.0", "blocks.1", "blocks.2"] and per_block.fullgraph == []
    wrapped = compiled_model.inspect(gpt(0, layers="fullgraph"))
    assert wrapped.parts == wrapped.fullgraph == ["blocks.0", "blocks.1", "blocks.2"]
    for fullgraph in (["blocks.0", "blocks.1", "blocks.2"], [""]):  # a unit compiled on its own is fine, inside not
        plan = compiled_model.CompiledModel(parts=["blocks.0"], fullgraph=fullgraph)
        units = [("blocks.0", torch.nn.Linear(1, 1))]
        if fullgraph == [""]:
            with pytest.raises(Exception, match="stage 3"):
                compiled_model.refuse_unworkable(plan, 3, units)
        else:
            compiled_model.refuse_unworkable(plan, 3, units)


@pytest.mark.parametrize("wrap", [[], ["Block"]])
def test_the_stage3_plan_of_a_compiled_model_is_the_plan_of_the_model(wrap: list[str]) -> None:
    """Compiled whole, the model is planned as itself (under `_orig_mod.`); compiled per layer
    (`torch.compile(block)` in its place), each layer's wrapper is the unit, so its hooks run outside the graph."""
    from torch._dynamo.eval_frame import OptimizedModule

    from zerorun.runtime.stage3.module_units import plan_stage3

    def plan(model: torch.nn.Module) -> list[tuple[str, int]]:
        groups = [[p for p in model.parameters() if p.requires_grad]]
        cut = plan_stage3(model, groups, wrap, 0, 2**20, 2**20, 2, torch.float32)
        return [(g.name, g.numel) for g in cut.gathered_units()]

    eager = plan(tied_gpt(0))
    assert eager and [(name.removeprefix("_orig_mod."), n) for name, n in plan(torch.compile(tied_gpt(0)))] == eager
    layered = gpt(0, layers="fullgraph")
    groups = [[p for p in layered.parameters() if p.requires_grad]]
    units = plan_stage3(layered, groups, wrap, 0, 2**20, 2**20, 2, torch.float32).gathered_units()
    assert [(g.name, g.numel) for g in units] == eager and all(isinstance(g.module, OptimizedModule) for g in units)


def _resume_across_compile(rank: int, world: int, directory: str, stage: int) -> tuple[list[str], bool, int]:
    """Train a step eagerly and save; resume into a compiled model of other weights (nothing is compiled: no
    forward runs). What the resumed engine's state dict holds, and whether it equals the saved one."""
    import zerorun
    from tests.runtime.reference import batch
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [f"zero.stage={stage}", *BLOCK_UNITS,
                                                       f"checkpoint.dir={directory}/stage{stage}"])
    saved = zerorun.initialize(tied_gpt(0), None, recipe)
    saved.backward(saved(batch(0, rank, 0)))
    saved.step()
    saved.save_checkpoint(block=True)
    expected = saved.state_dict()
    resumed = zerorun.initialize(torch.compile(tied_gpt(1)), None, recipe)  # checkpoint.resume: auto
    state = resumed.state_dict()
    same = state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    return sorted(state), same, resumed.global_step


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_checkpoint_resumes_whether_the_script_compiles_or_not(tmp_path, stage: int) -> None:
    """Names are the model's own, compiled or not: torch.compile(model) would put `_orig_mod.` before each."""
    names, same, step = run_ranks(_resume_across_compile, 2, (str(tmp_path), stage))[0]
    assert step == 1 and same and "blocks.0.qkv.weight" in names and not any("_orig_mod" in n for n in names)
