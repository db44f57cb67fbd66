"""A checkpoint is whole or refused: an edited or damaged manifest, `latest` or file is an error naming
the file, for a resume (before any state changes), `zerorun checkpoint info` and `consolidate`.

One 2-rank fp16 stage 2 run with two param groups saves a checkpoint; every case edits a copy of it.
Edits that keep the manifest's checksum stale are caught by the checksum; edits sealed again with
a fresh checksum (a tool that rewrites manifests, a writer bug) by the structural checks.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from typer.testing import CliRunner

from tests.harness import run_ranks
from tests.runtime.reference import batch, engine_master_params, make_model

OVERRIDES = ["zero.stage=2", "precision.dtype=fp16", "precision.initial_loss_scale=1024", "zero.bucket_mb=0.0005",
             "checkpoint.resume=never"]
SAVED_STEP = 3


def _engine(overrides: list[str] = ()):
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [*OVERRIDES, *overrides])
    model = make_model(0)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "lr": 3e-3}, {"params": rest, "lr": 1e-3, "weight_decay": 0.0}])
    return zerorun.initialize(model, opt, recipe)


def _save(rank: int, world: int, directory: str) -> None:
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    engine = _engine()
    for micro in range(SAVED_STEP):
        engine.backward(engine(batch(0, rank, micro)))
        engine.step()
    engine.save_checkpoint(directory)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("integrity") / "good"
    run_ranks(_save, 2, (str(root),))
    return root


# -- the edits -------------------------------------------------------------------------------------
def _manifest(directory: Path) -> Path:
    return directory / f"step-{SAVED_STEP}" / "manifest.json"


def _edited(saved: Path, name: str, edit: Callable[[dict], Any], reseal: bool = False) -> Path:
    """A copy of the saved checkpoint whose manifest `edit` changed (sealed again with `reseal`)."""
    target = shutil.copytree(saved, saved.parent / name)
    manifest = json.loads(_manifest(target).read_text())
    edit(manifest)
    _write_manifest(target, manifest, reseal)
    return target


def _write_manifest(target: Path, manifest: dict, reseal: bool) -> None:
    from zerorun.runtime.checkpoint.manifest import CHECKSUM, sealed

    if reseal:
        manifest = sealed({k: v for k, v in manifest.items() if k != CHECKSUM})
    _manifest(target).write_text(json.dumps(manifest, indent=1))


def _first_piece(m: dict) -> list:
    return next(e["pieces"][0] for e in m["params"].values() if e["pieces"])


def _two_pieces_same_rank(m: dict) -> tuple[list, list]:
    """Pieces of two parameters in the same rank file and group."""
    seen: dict[tuple[int, int], list] = {}
    for entry in m["params"].values():
        for piece in entry["pieces"]:
            key = (piece[0], entry["group"])
            if key in seen:
                return seen[key], piece
            seen[key] = piece
    raise AssertionError("no two pieces share a rank file")


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """An edit setting the manifest value at `path` (keys and indices separated by '/')."""
    def edit(m: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]
        node = m
        for key in parents:
            node = node[key]
        node[last] = value(node[last]) if callable(value) else value
    return edit


def _shift_offset(m: dict) -> None:
    _first_piece(m)[1] += 1


def _offset_past_file(m: dict) -> None:
    _first_piece(m)[1] = m["group_numels"][0]


def _overlap(m: dict) -> None:
    a, b = _two_pieces_same_rank(m)
    b[1] = a[1]


def _drop_piece(m: dict) -> None:
    next(e for e in m["params"].values() if len(e["pieces"]) > 1)["pieces"].pop()


def _v1(m: dict) -> None:
    m.pop("sha256")
    m["version"] = 1


# name -> (edit, sealed again, what the message says besides the manifest's path)
STALE = {  # the checksum no longer matches
    "global-step": (_set("global_step", 30), False, "does not match its sha256 checksum"),
    "lr": (_set("optimizer/param_groups/1/lr", 0.1), False, "does not match its sha256 checksum"),
    "piece-offset": (_shift_offset, False, "does not match its sha256 checksum"),
    "loss-scale": (_set("loss_scaler/scale", 2.0**20), False, "does not match its sha256 checksum"),
    "no-checksum": (lambda m: m.pop("sha256"), False, "no sha256 checksum"),
}
RESEALED = {  # consistent checksum, impossible content
    "offset-past-file": (_offset_past_file, True, "file offset is"),
    "overlapping-pieces": (_overlap, True, "both claim element"),
    "piece-dropped": (_drop_piece, True, "pieces covering all"),
    "negative-lr": (_set("optimizer/param_groups/0/lr", -3e-3), True, "optimizer.param_groups[0].lr is -0.003"),
    "beta-one": (_set("optimizer/param_groups/1/betas/0", 1.0), True, "betas[0] is 1.0"),
    "steps-ahead": (_set("optimizer/groups/0/scalars/step/value", 99), True, "optimizer.groups[0].scalars.step is 99"),
    "stage-9": (_set("stage", 9), True, "stage is 9"),
    "file-outside": (lambda m: m["files"].update({"../escape.safetensors": {"bytes": 0, "crc32": 0}}), True,
                     "../escape.safetensors"),
    "rng-garbage": (_set("rng/1/torch", "AAAA"), True, "rng[1] is not an RNG state the generators accept"),
    "group-out-of-range": (lambda m: next(iter(m["params"].values())).update(group=2), True, "group is 2"),
    "v1-format": (_v1, False, "format version 1"),
}
CASES = {**STALE, **RESEALED}


@pytest.fixture(scope="module")
def damaged(saved: Path) -> dict[str, Path]:
    copies = {name: _edited(saved, name, edit, reseal) for name, (edit, reseal, _) in CASES.items()}
    for name, content in (("latest-escape", b"../good\n"), ("latest-binary", b"\xff\xfe\x00")):
        copies[name] = shutil.copytree(saved, saved.parent / name)
        (copies[name] / "latest").write_bytes(content)
    copies["extras-shape"] = _extras_broadcastable(saved)
    return copies


def _extras_broadcastable(saved: Path) -> Path:
    """model-extras holds a [1, 1] buffer where the model's is [9, 1] (copy_ would broadcast it); the
    manifest's file entry updated to its size and CRC32 and sealed: only the tensor headers disagree."""
    from safetensors.torch import load_file

    from zerorun.runtime.checkpoint.files import write_tensors

    target = shutil.copytree(saved, saved.parent / "extras-shape")
    extras = target / f"step-{SAVED_STEP}" / "model-extras.safetensors"
    tensors = {name: t.clone() for name, t in load_file(extras).items()}  # not views of the file rewritten
    tensors["position_scale"] = tensors["position_scale"][:1].clone()
    size, crc = write_tensors(extras, tensors)
    manifest = json.loads(_manifest(target).read_text())
    manifest["files"]["model-extras.safetensors"] = {"bytes": size, "crc32": crc}
    _write_manifest(target, manifest, reseal=True)
    return target


EXPECTED = {**{name: (f"step-{SAVED_STEP}/manifest.json", text) for name, (_, _, text) in CASES.items()},
            "latest-escape": ("latest-escape/latest", "holds '../good', not the tag of a checkpoint"),
            "latest-binary": ("latest-binary/latest", "holds bytes that are not text"),
            "extras-shape": ("model-extras.safetensors", "tensor position_scale is F32 [1, 1], the manifest says "
                                                         "F32 [9, 1]")}


# -- resume ----------------------------------------------------------------------------------------
def _fingerprint(engine) -> dict[str, Any]:
    masters = engine_master_params(engine)
    return {"step": engine.global_step, "lr": [g["lr"] for g in engine.optimizer.param_groups],
            "scale": engine.loss_scale, "rng": torch.get_rng_state().tolist(),
            "masters": {n: t.tolist() for n, t in masters.items()},
            "params": {n: t.float().tolist() for n, t in engine.module.state_dict().items()}}


def _resume_all(rank: int, world: int, copies: dict[str, str], good: str) -> dict[str, Any]:
    from zerorun.errors import ZerorunError
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    engine = _engine()
    before = _fingerprint(engine)
    out: dict[str, Any] = {"errors": {}, "unchanged": {}}
    for name, directory in copies.items():
        try:
            engine.load_checkpoint(directory)
            out["errors"][name] = None
        except ZerorunError as exc:
            out["errors"][name] = str(exc)
        out["unchanged"][name] = _fingerprint(engine) == before
    try:  # the recipe's resume path: zerorun.initialize with checkpoint.resume=auto
        _engine([f"checkpoint.dir={copies['global-step']}", "checkpoint.resume=auto"])
        out["auto"] = None
    except ZerorunError as exc:
        out["auto"] = str(exc)
    engine.load_checkpoint(good)
    out["good"] = _fingerprint(engine)
    return out


@pytest.fixture(scope="module")
def resumed(saved: Path, damaged: dict[str, Path]) -> list[dict[str, Any]]:
    return run_ranks(_resume_all, 2, ({n: str(p) for n, p in damaged.items()}, str(saved)), timeout=600)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_resume_refuses_an_edited_or_damaged_checkpoint_on_every_rank_before_any_state_changes(name, resumed, damaged):
    where, text = EXPECTED[name]
    messages = [r["errors"][name] for r in resumed]
    assert messages[0] is not None, f"{name}: the resume loaded an edited checkpoint"
    assert messages[0] == messages[1], f"{name}: ranks disagree: {messages}"
    assert where in messages[0] and text in messages[0], messages[0]
    assert all(r["unchanged"][name] for r in resumed), f"{name}: the refused load changed the engine's state"


def test_resume_auto_refuses_an_edited_manifest_and_the_intact_checkpoint_still_loads(resumed):
    for r in resumed:
        assert r["auto"] is not None and "does not match its sha256 checksum" in r["auto"], r["auto"]
        assert r["good"]["step"] == SAVED_STEP and r["good"]["lr"] == [3e-3, 1e-3], r["good"]


# -- zerorun checkpoint info / consolidate ----------------------------------------------------------
@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.parametrize("command", ["info", "consolidate"])
def test_info_and_consolidate_refuse_an_edited_or_damaged_checkpoint_naming_the_file(name, command, damaged,
                                                                                    tmp_path):
    from zerorun.cli import app

    out = tmp_path / "model.safetensors"
    args = ["checkpoint", command, str(damaged[name])] + (["--out", str(out)] if command == "consolidate" else [])
    result = CliRunner().invoke(app, args)
    where, text = EXPECTED[name]
    assert result.exit_code == 2, result.output
    assert result.output.startswith("zerorun: error: ") and "Traceback" not in result.output, result.output
    assert where in result.output and text in " ".join(result.output.split()), result.output
    assert not out.exists(), "consolidate wrote weights from a refused checkpoint"


def test_info_of_an_intact_checkpoint_shows_its_step_learning_rates_loss_scale_and_what_was_checked(saved):
    from zerorun.cli import app

    result = CliRunner().invoke(app, ["checkpoint", "info", str(saved), "--verify"])
    assert result.exit_code == 0, result.output
    rows = {" ".join(line.strip("│ ").split()) for line in result.output.splitlines()}
    for row in ("step │ 3", "learning rate │ 0.003, 0.001 (per param group)", "loss scale │ 1024",
                "checked │ manifest checksum, sizes, tensors and CRC32s"):
        assert row in rows, result.output


# -- format 1: refused, then upgraded --------------------------------------------------------------
def test_a_format_1_checkpoint_is_upgraded_after_its_files_are_checked_and_then_loads_as_saved(saved, damaged,
                                                                                               tmp_path):
    from zerorun.cli import app
    from zerorun.runtime.checkpoint import tools as checkpoint_tools

    v1 = shutil.copytree(damaged["v1-format"], tmp_path / "v1")
    message = " ".join(CliRunner().invoke(app, ["checkpoint", "info", str(v1)]).output.split())
    assert f"zerorun checkpoint upgrade {v1} --tag step-{SAVED_STEP}" in message, message
    result = CliRunner().invoke(app, ["checkpoint", "upgrade", str(v1)])
    assert result.exit_code == 0 and "upgraded from format 1" in result.output, result.output
    upgraded = json.loads(_manifest(v1).read_text())
    original = json.loads(_manifest(saved).read_text())
    assert {k: v for k, v in upgraded.items() if k not in ("sha256", "upgraded_from")} == \
        {k: v for k, v in original.items() if k != "sha256"}
    consolidated, expected = checkpoint_tools.consolidate(v1), checkpoint_tools.consolidate(saved)
    assert all(torch.equal(consolidated[k], expected[k]) for k in expected)
    again = CliRunner().invoke(app, ["checkpoint", "upgrade", str(v1)])
    assert again.exit_code == 2 and "already format 3" in again.output, again.output


def test_a_format_1_checkpoint_with_a_damaged_file_is_not_upgraded(damaged, tmp_path):
    from zerorun.cli import app

    v1 = shutil.copytree(damaged["v1-format"], tmp_path / "v1")
    shard = v1 / f"step-{SAVED_STEP}" / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x40
    shard.write_bytes(bytes(data))
    before = _manifest(v1).read_bytes()
    result = CliRunner().invoke(app, ["checkpoint", "upgrade", str(v1)])
    assert result.exit_code == 2 and "rank-00001.safetensors: CRC32 differs" in result.output, result.output
    assert _manifest(v1).read_bytes() == before


# -- any edit, any damaged byte ---------------------------------------------------------------------
def _leaves(node: Any, path: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [leaf for key, value in node.items() for leaf in _leaves(value, (*path, key))]
    if isinstance(node, list):
        return [leaf for i, value in enumerate(node) for leaf in _leaves(value, (*path, i))]
    return [path]


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if value == 0 else value * 1.5 if isinstance(value, float) else value + 1
    if value is None:
        return 0
    return value + "x"


def test_changing_any_single_value_of_the_manifest_is_refused(saved):
    from zerorun.runtime.checkpoint.manifest import CHECKSUM, check_integrity

    manifest = json.loads(_manifest(saved).read_text())
    leaves = [p for p in _leaves(manifest) if p != (CHECKSUM,)]
    for path in random.Random(0).sample(leaves, min(400, len(leaves))):
        edited = json.loads(json.dumps(manifest))
        node = edited
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = _changed(node[path[-1]])
        with pytest.raises(Exception, match="does not match its sha256 checksum"):
            check_integrity(_manifest(saved), edited)


def test_a_flipped_bit_anywhere_in_the_manifest_is_refused_or_changes_nothing(saved, tmp_path):
    from zerorun.errors import ZerorunError
    from zerorun.runtime.checkpoint.files import Checkpoint

    copy = shutil.copytree(saved, tmp_path / "flips")
    original = _manifest(saved).read_bytes()
    intact = json.loads(original)
    rng = random.Random(1)
    for _ in range(300):
        data = bytearray(original)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        _manifest(copy).write_bytes(bytes(data))
        try:
            opened = Checkpoint.open(copy)
        except ZerorunError as exc:
            assert "manifest.json" in str(exc), exc
            continue
        assert opened.manifest == intact, "a changed manifest was accepted"  # e.g. 1e-08 -> 1E-08
