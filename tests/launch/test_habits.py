"""The habits DDP and FSDP users bring train what they meant, or are refused at once: real launches of
`scripts/user_loop.py`, a loop written as such a user writes it (own optimizer, own LambdaLR, torch's
clip_grad_norm_, DDP-style accumulation).

A reference run several tests compare with is launched once per module (`launch_once`). Runs that must
agree are compared exactly where the arithmetic is the same (the same data, the same
operations in the same order: the printed losses and lrs are equal strings) and to 1e-6 relative
where only the order of a floating-point sum may differ.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

SCRIPT = "user_loop.py"
STEPS = 8


def keys(tmp_path: Path, stage: int = 2, accum: int = 2, **more: object) -> dict:
    base = {"train": {"steps": STEPS, "micro_batch_size": 4, "grad_accum_steps": accum},
            "zero": {"stage": stage}, "launch": {"kill_grace_s": 1.0}, "telemetry": {"interval_s": 0.2}}
    for section, values in more.items():
        base.setdefault(section, {}).update(values)
    return base


def updates(job) -> dict[int, tuple[str, str]]:
    """update -> (loss, lr) as rank 0 printed them, the last time it ran that update."""
    found = {}
    for line in job.stdout:
        match = re.search(r"\] update (\d+) loss (\S+) lr (\S+)", line)
        if match:
            found[int(match.group(1))] = (match.group(2), match.group(3))
    return found


def checksum(job) -> float:
    return float(next(m.group(1) for m in (re.search(r"\] checksum (\S+)$", line) for line in job.stdout) if m))


def finished(job) -> object:
    assert job.wait(timeout=300) == 0, job.output
    return job


def refused(job) -> str:
    assert job.wait(timeout=300) != 0, job.output
    assert not updates(job), f"the job trained before it was refused:\n{job.output}"
    return "\n".join(job.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("built", ["after", "before"])
def test_a_resumed_job_continues_the_scripts_own_lr_schedule(launch, launch_once, tmp_path, built):
    """A LambdaLR the script builds on its optimizer (after zerorun.initialize or before it) is saved with the
    checkpoints that checkpoint.every_steps takes inside engine.step() and restored by the restart: the lrs and
    losses after the resume equal an uninterrupted run's (on the old main the warm-up started again)."""
    ckpt = {"dir": str(tmp_path / "ckpt"), "every_steps": 3}
    job = finished(launch(SCRIPT, ["--schedule", built, "--fail-at", "5", "--once", str(tmp_path / "once")],
                          **keys(tmp_path, checkpoint=ckpt, launch={"max_restarts": 1})))
    assert "resumed from step-3 at update 3" in "\n".join(job.stdout), job.output
    reference = finished(launch_once(SCRIPT, [] if built == "after" else ["--schedule", built], **keys(tmp_path)))
    assert updates(job) == updates(reference)
    assert checksum(job) == checksum(reference)


@pytest.mark.slow
def test_a_ddp_style_accumulation_loop_is_refused_before_it_updates(launch, tmp_path):
    """W x backward(loss / W) then one step(), while the recipe accumulates too: half the updates and the loss
    divided twice on the old main, exit 0; now refused at the first window, naming the recipe line and both ways."""
    stderr = refused(launch(SCRIPT, ["--accum", "ddp"], **keys(tmp_path, accum=2)))
    assert "engine.backward() called again before engine.step()" in stderr
    assert re.search(r"train\.grad_accum_steps: 2 \(\S+recipe\.yaml:\d+\)", stderr), stderr
    assert "(1) engine.backward(loss) and engine.step() for every micro-batch" in stderr
    assert "(2) set train.grad_accum_steps: 1" in stderr


@pytest.mark.parametrize("stage,accum,refusal", [(1, "ddp", "at stage 1 a window's gradients are reduced once"),
                                                 (1, "no_sync", None), (2, "ddp", None)])
@pytest.mark.slow
def test_the_scripts_own_accumulation_trains_as_the_engines(launch, launch_once, tmp_path, stage, accum, refusal):
    """With train.grad_accum_steps: 1 a script may accumulate itself: at stage 1 with no_sync() around all but the
    last backward (without it the window's first gradients would be reduced twice: refused), at stage 2 as it is.
    It trains as the engine's own accumulation over the same micro-batches."""
    job = launch(SCRIPT, ["--accum", accum, "--window", "2"], **keys(tmp_path, stage=stage, accum=1))
    if refusal is not None:
        assert refusal in refused(job)
        return
    finished(job)
    reference = finished(launch_once(SCRIPT, **keys(tmp_path, stage=stage, accum=2)))  # --accum zerorun: the default
    ours, theirs = updates(job), updates(reference)
    assert ours.keys() == theirs.keys() == set(range(STEPS))
    for update in ours:  # the loss is divided by the script instead of the engine: the same product, rounded once
        assert float(ours[update][0]) == pytest.approx(float(theirs[update][0]), rel=1e-6), update
    assert checksum(job) == pytest.approx(checksum(reference), rel=1e-6)
    # telemetry reports the loss the script computed, not the loss / W it handed to backward (issue 57: it showed 1/W)
    records = [json.loads(line) for line in next((tmp_path / "runs").glob("*/telemetry.jsonl")).read_text().splitlines()]
    reported = [r["loss"] for r in sorted((r for r in records if r.get("type") == "step" and r.get("rank") == 0),
                                          key=lambda r: r["step"])]
    assert reported == pytest.approx([float(ours[update][0]) for update in sorted(ours)], rel=1e-5), reported


@pytest.mark.slow
def test_torch_clip_grad_norm_on_the_models_parameters_clips_the_engines_update(launch, launch_once, tmp_path):
    """clip_grad_norm_(model.parameters(), 0.5) found no gradient under the engine and clipped nothing; now it
    trains as train.clip_grad_norm: 0.5 does, returns the global norm, and differs from an unclipped run."""
    clipped = finished(launch(SCRIPT, ["--clip", "0.5"], **keys(tmp_path)))
    by_recipe = finished(launch(SCRIPT, **keys(tmp_path, train={"clip_grad_norm": 0.5})))
    unclipped = finished(launch_once(SCRIPT, **keys(tmp_path)))
    assert updates(clipped) == updates(by_recipe)
    assert updates(clipped) != updates(unclipped)
    norms = [float(m.group(1)) for m in (re.search(r"\] clip norm (\S+)$", line) for line in clipped.stdout) if m]
    engine_norms = [float(m.group(1)) for m in (re.search(r"grad-norm (\S+)$", line) for line in clipped.stdout) if m]
    assert len(norms) == STEPS and norms == pytest.approx(engine_norms, rel=1e-5)
    assert all(n > 0.5 for n in norms)  # so every update was clipped


@pytest.mark.slow
def test_recipe_optimizer_keys_beside_the_scripts_optimizer_are_refused(launch, tmp_path):
    """The recipe's optimizer.lr and weight_decay were silently ignored when the script passed its own AdamW."""
    stderr = refused(launch(SCRIPT, **keys(tmp_path, optimizer={"lr": 1e-4, "weight_decay": 0.5})))
    assert re.search(r"the recipe sets optimizer\.lr \(\S+recipe\.yaml:\d+\), optimizer\.weight_decay "
                     r"\(\S+recipe\.yaml:\d+\), but the script passes its own AdamW", stderr), stderr


@pytest.mark.slow
def test_a_recipe_schedule_beside_the_scripts_own_is_refused_and_alone_is_stepped_by_the_engine(launch, tmp_path):
    """The recipe's scheduler section was ignored by a native script; now the engine steps it after every update,
    and a script that also drives the lr with its own scheduler is refused, naming both."""
    warmup = {"type": "WarmupLR", "warmup_min_lr": 0.0, "warmup_max_lr": 0.002, "warmup_num_steps": 4,
              "warmup_type": "linear"}
    stderr = refused(launch(SCRIPT, **keys(tmp_path, scheduler=warmup)))
    assert re.search(r"two learning-rate schedulers drive the engine's optimizer: the recipe's WarmupLR "
                     r"\(scheduler\.type at \S+recipe\.yaml:\d+\), which the engine steps, and a LambdaLR", stderr)
    job = finished(launch(SCRIPT, ["--schedule", "none"], **keys(tmp_path, scheduler=warmup)))
    lrs = [float(lr) for _, (_, lr) in sorted(updates(job).items())]
    # DeepSpeed's WarmupLR: the first update runs at iteration -1's lr (0), then 0/4, 1/4, ... of the way up
    assert lrs[:6] == pytest.approx([0.0, 0.0, 0.0005, 0.001, 0.0015, 0.002])
