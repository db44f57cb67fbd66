"""Background checkpoints: the same bytes as a synchronous save, training going on meanwhile, one in flight.

Every case trains 3 steps on 2 ranks, saves synchronously into `sync/t`, then asynchronously into
`async/t` with a writer slowed down (`SLOW_ENV`: it sleeps per written chunk), and trains 2 more
steps while that save writes. The async files must equal the synchronous ones byte for byte (the
manifest less its time stamp and checksum): a snapshot that read the live state, which those 2
steps change, would differ. The save must still be unfinished after the next forward and backward, and (unless the state is on NVMe,
where the optimizer step waits until the writer has streamed it) after the 2 steps: training went on.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.reference import OPT, batch, make_model
from zerorun.runtime.checkpoint import background as checkpoint_async
from zerorun.runtime.checkpoint.background import SLOW_ENV
from zerorun.runtime.checkpoint.files import tags

_NVME_DIR = tempfile.mkdtemp(prefix="zerorun-async-nvme-", dir="/var/tmp" if Path("/var/tmp").is_dir() else None)
OFFLOAD = ["zero.offload_optimizer.device=cpu"]
NVME = ["zero.offload_optimizer.device=nvme", f"zero.offload_optimizer.nvme_path={_NVME_DIR}",
        "zero.offload_optimizer.buffer_mb=0.002"]
CASES = {"stage0": ["zero.stage=0"], "stage1": ["zero.stage=1"], "stage2-bf16": ["zero.stage=2", "precision.dtype=bf16"],
         "stage3": ["zero.stage=3"], "stage2-cpu-offload": ["zero.stage=2", *OFFLOAD],
         "stage3-cpu-offload": ["zero.stage=3", *OFFLOAD, "zero.offload_param.device=cpu"],
         "stage2-nvme": ["zero.stage=2", *NVME, "name=async-s2"],
         "stage3-nvme-bf16": ["zero.stage=3", "precision.dtype=bf16", *NVME, "name=async-s3"]}


def _engine(overrides: list[str]):
    import zerorun
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", ["checkpoint.resume=never", "zero.bucket_mb=0.0005", *overrides])
    model = make_model(0)
    return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), **OPT), recipe)


def _train(engine, rank: int, first: int, count: int) -> None:
    for micro in range(first, first + count):
        loss = engine(batch(0, rank, micro))
        engine.backward(loss)
        engine.step()


def _same_bytes_case(rank: int, world: int, root: str, overrides: list[str]) -> dict:
    engine = _engine(overrides)
    _train(engine, rank, 0, 3)
    client = {"epoch": torch.tensor([3.0])}  # not JSON: saved as client_state.pt
    engine.recipe.checkpoint.async_save = False
    engine.save_checkpoint(f"{root}/sync", tag="t", client_state=client)
    engine.recipe.checkpoint.async_save = True
    os.environ[SLOW_ENV] = "0.4"
    try:
        engine.save_checkpoint(f"{root}/async", tag="t", client_state=client)
    finally:
        del os.environ[SLOW_ENV]
    client["epoch"] += 1  # the script's later changes are not saved
    engine.backward(engine(batch(0, rank, 3)))
    unfinished = [not engine.checkpoints.current.finished.is_set()]  # a forward and backward ran meanwhile
    engine.step()
    _train(engine, rank, 4, 1)
    unfinished.append(not engine.checkpoints.current.finished.is_set())  # two steps (host snapshot only)
    engine.wait_checkpoint()
    return {"unfinished": unfinished, "snapshot": engine.memory().total("snapshot"),
            "numels": sum(engine.store.group_numels), "shard": rank < engine.store.shard_world,
            "nvme": "nvme" in " ".join(overrides)}


@pytest.mark.parametrize("case", [c if c == "stage3" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_async_checkpoint_equals_the_synchronous_one_byte_for_byte_while_training_goes_on(case, tmp_path):
    results = run_ranks(_same_bytes_case, 2, (str(tmp_path), CASES[case]))
    sync, background = tmp_path / "sync" / "t", tmp_path / "async" / "t"
    assert sorted(p.name for p in sync.iterdir()) == sorted(p.name for p in background.iterdir())
    for file in sync.iterdir():
        if file.name == "manifest.json":
            a, b = json.loads(file.read_text()), json.loads((background / file.name).read_text())
            for key in ("saved_at", "sha256"):
                a.pop(key), b.pop(key)
            assert a == b
        else:
            assert file.read_bytes() == (background / file.name).read_bytes(), file.name
    assert (tmp_path / "async" / "latest").read_text() == "t\n"
    assert not list((tmp_path / "async").glob(".*")), "no temporary directory or marker is left"
    for r in results:
        if r["shard"]:  # stage 0 saves rank 0's state only: rank 1 has nothing to write
            assert r["unfinished"][0], "a forward and backward ran while the save was writing"
            # with the state on NVMe the optimizer step waits until the writer has streamed it
            assert r["unfinished"][1] or r["nvme"], "two steps completed while the save was writing"
        # the snapshot: the whole flat state in host memory, or one streaming chunk for NVMe
        expected = 0 if not r["shard"] else 4 * min(r["numels"], 1 << 24) if r["nvme"] else 12 * r["numels"]
        assert r["snapshot"] == expected


# -- one save in flight, telemetry, keep_last, every_minutes ---------------------------------------------
def _cadence_case(rank: int, world: int, root: str) -> dict:
    from zerorun.runtime import context

    records: list = []
    context.current().events.subscribe_checkpoints(records.append)
    engine = _engine(["zero.stage=2", f"checkpoint.dir={root}", "checkpoint.every_steps=2", "checkpoint.keep_last=2"])
    os.environ[SLOW_ENV] = "0.3"  # step-2's save is still writing when step 4 asks for the next one
    _train(engine, rank, 0, 2)
    del os.environ[SLOW_ENV]
    _train(engine, rank, 2, 6)  # saves step-4 (after waiting for step-2), step-6, step-8
    engine.wait_checkpoint()
    engine.recipe.checkpoint.every_steps, engine.recipe.checkpoint.every_minutes = 0, 60.0
    if rank == 0:  # one rank's clock says an hour has passed: every rank saves at the next step
        engine.checkpoints.last_save -= 3600
    _train(engine, rank, 8, 2)  # step 9 saves, step 10 does not
    engine.wait_checkpoint()
    return {"records": [vars(r) for r in records], "memory": engine.memory().total("snapshot"),
            "numels": sum(engine.store.group_numels)}


@pytest.mark.slow
def test_one_save_in_flight_keep_last_every_minutes_and_a_record_per_save(tmp_path):
    results = run_ranks(_cadence_case, 2, (str(tmp_path),))
    assert tags(tmp_path) == ["step-8", "step-9"]  # keep_last: 2
    assert (tmp_path / "latest").read_text() == "step-9\n"
    for r in results:
        records = {rec["tag"]: rec for rec in r["records"]}
        assert list(records) == ["step-2", "step-4", "step-6", "step-8", "step-9"]
        assert records["step-4"]["waited_s"] > 0.2, "step-4 waited for step-2 (0.3 s per tensor written)"
        assert records["step-4"]["stall_s"] >= records["step-4"]["waited_s"]
        assert records["step-2"]["write_s"] > 0.5 and records["step-2"]["waited_s"] < records["step-4"]["waited_s"]
        for rec in r["records"]:
            assert rec["mode"] == "async" and rec["bytes"] > 0 and rec["snapshot_bytes"] == 12 * r["numels"]
            assert set(rec) == {"tag", "step", "mode", "stall_s", "waited_s", "write_s", "bytes", "snapshot_bytes"}
        assert r["memory"] == 12 * r["numels"]


# -- the host cannot hold a snapshot: synchronous, one warning --------------------------------------------
def _small_host_case(rank: int, world: int, root: str) -> dict:
    import logging
    from types import SimpleNamespace
    from unittest import mock

    from zerorun.runtime import context

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage()) if record.levelno >= logging.WARNING else None
    logging.getLogger("zerorun").addHandler(handler)
    records: list = []
    context.current().events.subscribe_checkpoints(records.append)
    engine = _engine(["zero.stage=1", f"checkpoint.dir={root}"])
    _train(engine, rank, 0, 1)
    available = 1000 if rank == 1 else 1 << 40  # only rank 1 lacks memory; both must save the same way
    with mock.patch("zerorun.runtime.checkpoint.background.psutil.virtual_memory",
                    return_value=SimpleNamespace(available=available)):
        engine.save_checkpoint()
        _train(engine, rank, 1, 1)
        engine.save_checkpoint()
    return {"modes": [r.mode for r in records], "warnings": warnings, "snapshot": engine.memory().total("snapshot")}


@pytest.mark.slow
def test_a_host_too_small_for_the_snapshot_saves_synchronously_with_one_warning_naming_the_numbers(tmp_path):
    results = run_ranks(_small_host_case, 2, (str(tmp_path),))
    assert tags(tmp_path) == ["step-1", "step-2"]
    for rank, r in enumerate(results):
        assert r["modes"] == ["sync-fallback", "sync-fallback"] and r["snapshot"] == 0
        shown = [w for w in r["warnings"] if "snapshot needs" in w]
        assert len(shown) == (1 if rank == 1 else 0), r["warnings"]
    assert "GiB of host memory and 0.00 GiB are available" in [w for w in results[1]["warnings"]
                                                                 if "snapshot needs" in w][0]


def test_the_writer_niceness_applies_to_the_writer_thread_only():
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before, seen = niceness(), []

    def writer() -> None:
        checkpoint_async._lower_priority(5)
        seen.append(niceness())

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen == [min(19, before + 5)] and niceness() == before
