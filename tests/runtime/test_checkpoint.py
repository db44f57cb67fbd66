"""Checkpoints: exact resume, resume on another world size and stage, consolidation, damage.

Data depend on the micro-step only: each micro-step draws one global batch of 6 sequences and rank r
of W takes rows [6r/W, 6(r+1)/W). Every rank's loss is a mean over the same number of tokens and the
engine averages gradients over ranks, so 2 and 3 ranks compute the same global gradient (up to the
order of the sums): a run that changes world size or stage halfway is compared with the run that
did not. Three process groups run in turn (2 ranks, 3 ranks, 2 ranks); each resumes from what the
one before saved, and each case's uninterrupted run is its reference.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.harness import run_ranks
from tests.runtime.reference import OPT, SEQ, VOCAB, make_model

STEPS, HALF, ACCUM = 20, 10, 2
GLOBAL_BATCH = 6
# A resume on another world size or stage sums gradients in another order (other reduction pieces,
# other units), as DDP on another world size would: parity-level tolerances (test_engine_parity.py).
LOSS_RTOL, PARAM_ATOL = 1e-5, 5e-7
OFFLOAD = ["zero.offload_optimizer.device=cpu", "zero.offload_optimizer.buffer_mb=0.002"]
# NVMe offload needs a real disk (O_DIRECT); /var/tmp is one on CI and here (tmp_path is a fixture, too late)
_NVME_DIR = tempfile.mkdtemp(prefix="zerorun-ckpt-nvme-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None)
NVME = ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={_NVME_DIR}",
        "zero.offload_optimizer.buffer_mb=0.002"]
NVME_PARAM = ["zero.offload_param.device=nvme", f"zero.offload_param.nvme_path={_NVME_DIR}"]

# (name, recipe overrides): each is trained 20 steps uninterrupted, and 10 + save + load + 10
EXACT = {
    2: [("stage0", ["zero.stage=0"]), ("stage1", ["zero.stage=1"]), ("stage2", ["zero.stage=2"]),
        ("stage3", ["zero.stage=3"]), ("stage2-bf16", ["zero.stage=2", "precision.dtype=bf16"]),
        ("stage1-fp16", ["zero.stage=1", "precision.dtype=fp16", "precision.initial_loss_scale=1024"]),
        ("stage2-offload", ["zero.stage=2", *OFFLOAD]),
        ("stage3-offload-bf16", ["zero.stage=3", "precision.dtype=bf16", *OFFLOAD,
                                 "zero.offload_param.device=cpu"]),
        ("stage2-nvme-bf16", ["zero.stage=2", "precision.dtype=bf16", *NVME, "name=ckpt-s2"]),
        ("stage3-nvme", ["zero.stage=3", *NVME, *NVME_PARAM, "name=ckpt-s3"])],
    3: [("stage0", ["zero.stage=0"]), ("stage1", ["zero.stage=1"]), ("stage2", ["zero.stage=2"]),
        ("stage3", ["zero.stage=3"]), ("stage3-bf16", ["zero.stage=3", "precision.dtype=bf16"]),
        ("stage1-offload", ["zero.stage=1", *OFFLOAD])],
}
# (saved on, saved case, resumed on, resumed with): loads another group's checkpoint at step 10
RESHARD = [(2, "stage3", 3, ["zero.stage=2"]), (2, "stage1", 3, ["zero.stage=1"]),
           (3, "stage1", 2, ["zero.stage=1"]), (3, "stage2", 2, ["zero.stage=3"])]


def global_batch(micro: int, rank: int, world: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + micro))
    per_rank = GLOBAL_BATCH // world
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def _engine(overrides: list[str]):
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [f"train.grad_accum_steps={ACCUM}", "zero.bucket_mb=0.0005",
                                                        "checkpoint.resume=never", *overrides])
    model = make_model(0)
    return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), **OPT), recipe)


def _train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    """Optimizer steps [first, last); this rank's loss per micro-step."""
    losses = []
    for micro in range(first * ACCUM, last * ACCUM):
        loss = engine(global_batch(micro, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(engine) -> dict[str, torch.Tensor]:
    """The fp32 state dict (master weights for trainable parameters) on rank 0, {} elsewhere."""
    import torch.distributed as dist

    from tests.runtime.reference import engine_master_params

    if engine.stage == 3:
        return engine.state_dict()
    masters = engine_master_params(engine)
    first = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    state = {key: masters.get(first.get(id(value)), value).detach().float().clone()
             for key, value in engine.module.state_dict(keep_vars=True).items()}
    return state if dist.get_rank() == 0 else {}


def _phase(rank: int, world: int, root: str, exact: list, resumes: list, damaged: list, ddp: bool = False) -> bytes:
    """Exact-resume cases (saving at step 10 under root/w<world>-<name>), resumes of other groups'
    checkpoints, loads of damaged copies (their error messages) and, with `ddp`, DDP's state after 10 steps."""
    import torch.distributed as dist

    from zerorun.errors import ZerorunError
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    out: dict = {"exact": {}, "resumed": {}, "damaged": {}, "ddp": _ddp_state_after_half(rank, world) if ddp else {}}
    for name, overrides in exact:
        whole = _engine(overrides)
        losses = _train(whole, rank, world, 0, STEPS)
        reference = _state(whole)
        del whole
        first = _engine(overrides)
        head = _train(first, rank, world, 0, HALF)
        saved_state = _state(first)
        first.save_checkpoint(f"{root}/w{world}-{name}", client_state={"case": name, "rank0_loss": head[-1]})
        rng_after_save = torch.rand(4)
        del first
        second = _engine(overrides)
        client = second.load_checkpoint(f"{root}/w{world}-{name}")
        rng_after_load = torch.rand(4)
        tail = _train(second, rank, world, HALF, STEPS)
        out["exact"][name] = dict(losses=losses, resumed=head + tail, reference=reference, final=_state(second),
                                  saved=saved_state, client=client, step=second.global_step,
                                  rng=torch.equal(rng_after_save, rng_after_load), tag=second.resumed_from)
        dist.barrier()
    for source, overrides in resumes:
        engine = _engine(overrides)
        engine.load_checkpoint(f"{root}/{source}")
        out["resumed"][source] = dict(losses=_train(engine, rank, world, HALF, STEPS), final=_state(engine))
        dist.barrier()
    for name, overrides, model_fn, directory in damaged:
        import zerorun
        from zerorun import config

        recipe = config.loads("script: t.py\n", "t.yaml", ["checkpoint.resume=never", *overrides])
        engine = zerorun.initialize(model_fn(), None, recipe)
        try:
            engine.load_checkpoint(directory)
            out["damaged"][name] = None
        except ZerorunError as exc:
            out["damaged"][name] = str(exc)
    buffer = io.BytesIO()  # tensors through the result queue would need their sender alive
    torch.save(out, buffer)
    return buffer.getvalue()


def _run(world: int, *args) -> list[dict]:
    return [torch.load(io.BytesIO(r), weights_only=True) for r in run_ranks(_phase, world, args, timeout=300)]


# -- the three process groups ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def on_two(root: Path) -> list[dict]:
    return _run(2, str(root), EXACT[2], [], [], True)


@pytest.fixture(scope="module")
def on_three(root: Path, on_two: list[dict]) -> list[dict]:
    resumes = [(f"w{a}-{name}", overrides) for a, name, b, overrides in RESHARD if (a, b) == (2, 3)]
    return _run(3, str(root), EXACT[3], resumes, _damaged_copies(root))


@pytest.fixture(scope="module")
def on_two_again(root: Path, on_three: list[dict]) -> list[dict]:
    resumes = [(f"w{a}-{name}", overrides) for a, name, b, overrides in RESHARD if (a, b) == (3, 2)]
    return _run(2, str(root), [], resumes, [])


def _results(world: int, on_two, on_three) -> list[dict]:
    return on_two if world == 2 else on_three


# -- exact resume ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world,name", [(w, n) for w, cases in EXACT.items() for n, _ in cases])
def test_ten_steps_save_load_ten_steps_equals_twenty_steps_bit_for_bit(world, name, on_two, on_three):
    ranks = [r["exact"][name] for r in _results(world, on_two, on_three)]
    for rank, case in enumerate(ranks):
        assert case["resumed"] == case["losses"], f"rank {rank}: losses differ after the resume"
        assert case["step"] == STEPS and case["tag"] == f"step-{HALF}"
        assert case["client"]["case"] == name and case["rng"], f"rank {rank}: client state or RNG not restored"
    reference, final = ranks[0]["reference"], ranks[0]["final"]
    assert list(reference) == list(final) == list(make_model().state_dict())
    for key, value in reference.items():
        assert torch.equal(final[key], value), f"{key} differs by {(final[key] - value).abs().max():.2e}"


# -- another world size and stage ------------------------------------------------------------------
def _global_losses(ranks: list[list[float]]) -> torch.Tensor:
    return torch.tensor(ranks, dtype=torch.float64).mean(dim=0)


@pytest.mark.parametrize("saved_on,case,resumed_on,overrides", RESHARD,
                         ids=[f"{a}ranks-{c}-to-{b}ranks-stage{o[0][-1]}" for a, c, b, o in RESHARD])
@pytest.mark.slow
def test_resume_on_another_world_size_and_stage_continues_like_the_uninterrupted_run(
        saved_on, case, resumed_on, overrides, on_two, on_three, on_two_again):
    saved = [r["exact"][case] for r in _results(saved_on, on_two, on_three)]
    resumed = [r["resumed"][f"w{saved_on}-{case}"] for r in (on_three if resumed_on == 3 else on_two_again)]
    expected = _global_losses([s["losses"] for s in saved])[HALF * ACCUM:]
    got = _global_losses([r["losses"] for r in resumed])
    assert torch.allclose(got, expected, rtol=LOSS_RTOL, atol=0), (got - expected).abs().max()
    assert list(saved[0]["reference"]) == list(resumed[0]["final"]) == list(make_model().state_dict())
    for key, value in saved[0]["reference"].items():
        diff = (resumed[0]["final"][key] - value).abs().max().item()
        assert diff <= PARAM_ATOL, f"{key} differs by {diff:.2e}"


# -- consolidation ---------------------------------------------------------------------------------
def _ddp_state_after_half(rank: int, world: int) -> dict[str, torch.Tensor]:
    """DDP + torch AdamW on the same global batches for 10 steps: rank 0's state dict."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    for micro in range(HALF * ACCUM):
        (ddp(global_batch(micro, rank, world)) / ACCUM).backward()
        if (micro + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else {}


@pytest.mark.parametrize("case", ["stage2", "stage3"])
def test_consolidated_state_dict_equals_ddp_and_the_engine_and_loads_strict(root, on_two, case, tmp_path):
    from zerorun.cli import app
    from zerorun.runtime.checkpoint import tools as checkpoint

    directory = root / f"w2-{case}"
    state = checkpoint.consolidate(directory)
    saved = on_two[0]["exact"][case]["saved"]
    assert list(state) == list(saved)  # every key, in the model's order
    for key, value in saved.items():
        assert torch.equal(state[key], value), f"{key}: consolidation differs from the engine's master weights"
    for key, value in on_two[0]["ddp"].items():
        assert (state[key] - value).abs().max() <= PARAM_ATOL, key
    for suffix in ("safetensors", "pt"):
        out = tmp_path / f"model.{suffix}"
        result = CliRunner().invoke(app, ["checkpoint", "consolidate", str(directory), "--out", str(out)])
        assert result.exit_code == 0, result.output
        if suffix == "pt":
            loaded = torch.load(out, weights_only=True)
        else:
            from safetensors.torch import load_file
            loaded = load_file(out)
        model = make_model(1)
        model.load_state_dict(loaded, strict=True)
        assert torch.equal(model.head.weight, saved["head.weight"]) and model.head.weight is model.embed.weight


def test_checkpoint_info_shows_step_world_stage_precision_and_sizes(root, on_two):
    from zerorun.cli import app

    result = CliRunner().invoke(app, ["checkpoint", "info", str(root / "w2-stage2-bf16")])
    assert result.exit_code == 0, result.output
    rows = {" ".join(line.strip("│ ").split()) for line in result.output.splitlines()}
    for row in ("tag │ step-10 (latest)", "step │ 10", "world size │ 2 ranks", "ZeRO stage │ 2",
                "precision │ bf16", "client_state │ case, rank0_loss", "tags here │ step-10; latest: step-10"):
        assert row in rows, result.output
    for name in ("rank-00000.safetensors", "rank-00001.safetensors", "model-extras.safetensors"):
        nbytes = (root / "w2-stage2-bf16" / "step-10" / name).stat().st_size
        assert f"{name} │ {nbytes:,} bytes" in rows, result.output


# -- damage ----------------------------------------------------------------------------------------------
def _copy(root: Path, name: str) -> Path:
    target = root / f"damaged-{name}"
    shutil.copytree(root / "w2-stage2", target)
    return target


def _damaged_copies(root: Path) -> list:
    """Damaged copies of the 2-rank stage 2 checkpoint, loaded by the 3-rank group."""
    missing = _copy(root, "missing")
    (missing / "step-10" / "rank-00001.safetensors").unlink()
    flipped = _copy(root, "flipped")
    shard = flipped / "step-10" / "rank-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    stage2 = ["zero.stage=2", "zero.bucket_mb=0.0005"]
    return [("missing", stage2, make_model, str(missing)), ("flipped", stage2, make_model, str(flipped)),
            ("wider", stage2, _wider_model, str(root / "w2-stage2")),
            ("missing-tag", stage2, make_model, str(root / "nothing-here"))]


def _wider_model() -> torch.nn.Module:
    model = make_model(0)
    model.up = torch.nn.Linear(model.up.in_features, 31)
    model.down = torch.nn.Linear(31, model.down.out_features)
    return model


def test_damaged_checkpoints_fail_on_every_rank_with_a_message_naming_the_file(on_three):
    messages = [r["damaged"] for r in on_three]
    for name in ("missing", "flipped", "wider"):
        assert len({m[name] for m in messages}) == 1, f"{name}: ranks disagree: {[m[name] for m in messages]}"
    damaged = messages[0]
    assert "damaged-missing/step-10/rank-00001.safetensors: missing" in damaged["missing"]
    assert "damaged-flipped/step-10/rank-00000.safetensors: CRC32 differs" in damaged["flipped"]
    assert "w2-stage2/step-10/manifest.json does not describe this model" in damaged["wider"]
    assert "parameter up.weight: shape [31, 13] here, [29, 13] in the checkpoint" in damaged["wider"]
    assert damaged["missing-tag"] is None  # no checkpoint in the directory: nothing to resume


def test_truncated_file_bad_manifest_and_missing_tag_are_errors_naming_the_file(root, on_two, tmp_path):
    from zerorun.cli import app
    from zerorun.errors import ZerorunError
    from zerorun.runtime.checkpoint import tools as checkpoint

    def error(directory: Path, tag: str | None = None) -> str:
        with pytest.raises(ZerorunError) as info:
            checkpoint.consolidate(directory, tag)
        return str(info.value)

    truncated = shutil.copytree(root / "w2-stage1", tmp_path / "truncated")
    shard = truncated / "step-10" / "rank-00001.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:size // 2])
    assert f"truncated/step-10/rank-00001.safetensors: {size // 2} bytes, the manifest says {size}" \
        in error(truncated)
    manifest = truncated / "step-10" / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])
    assert "truncated/step-10/manifest.json: not valid JSON" in error(truncated)
    assert "step-99: no such checkpoint; tags in" in error(root / "w2-stage1", "step-99")
    assert error(root / "w2-stage1", "step-99").endswith("tags in " + str(root / "w2-stage1") + ": step-10.")
    result = CliRunner().invoke(app, ["checkpoint", "info", str(truncated)])
    assert result.exit_code == 2 and result.output.startswith("zerorun: error: ")
    assert "Traceback" not in result.output


def test_a_same_tag_save_interrupted_between_its_renames_keeps_the_old_copy_and_the_next_save_restores_it(
        root, on_two, tmp_path):
    from zerorun.runtime.checkpoint import files, tools

    ckpt = shutil.copytree(root / "w2-stage1", tmp_path / "ckpt")
    (ckpt / "step-10").rename(ckpt / ".old-step-10")  # replace_dir moved it aside, then the job died
    (ckpt / ".tmp-step-10").mkdir()  # the new copy that never arrived
    assert files.latest_tag(ckpt) == "step-10"
    assert files.Checkpoint.open(ckpt).path == ckpt / ".old-step-10"
    files.clean_crashed_saves(ckpt)  # what the next save does first
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-10"]
    assert list(tools.consolidate(ckpt)) == list(make_model().state_dict())


def test_a_full_checkpoint_disk_names_the_path_and_the_checkpoint_kept(tmp_path: Path):
    import subprocess

    from zerorun.errors import ZerorunError
    from zerorun.runtime.checkpoint.files import write_tensors

    root = tmp_path / "ckpt"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        from zerorun.runtime.checkpoint.files import MANIFEST

        for tag in ("step-1", "step-5"):
            (root / tag).mkdir()
            (root / tag / MANIFEST).write_text("{}")
        (root / "latest").write_text("step-5\n")
        (root / ".tmp-step-10").mkdir()
        target = root / ".tmp-step-10" / "rank-00000.safetensors"
        with pytest.raises(ZerorunError) as err:
            write_tensors(target, {"master.0": torch.zeros(1 << 20)})  # 4 MiB on a 1 MiB disk
        assert str(err.value).startswith(f"{target}: no space left on the checkpoint disk (")
        assert "the last complete checkpoint, step-5, is kept; tags there: step-1, step-5." in str(err.value)
        assert not target.exists()  # the partial file gives its space back
    finally:
        subprocess.run(["umount", "-l", str(root)])
