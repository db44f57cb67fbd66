"""Nothing outside zerorun is different after an engine is gone from what it was before it was built.

Each rank records every attribute of the torch modules zerorun intercepts (and of the classes it could
patch) and of the script's own objects (the model, its submodules, the optimizer it hands over, its
LR scheduler: their class and every `__dict__` entry), builds an engine over them with every
interception on (a handed-over optimizer, `zero.overlap_publish`'s guard on the root, a
`clip_grad_norm_` through torch), trains, ends the engine, and compares: the same objects (`is`).
The check also proves the interceptions were on while the engine lived, so it cannot pass vacuously.
"""

from __future__ import annotations

import types

import pytest

from tests.harness import run_ranks

# What the script's own training changes on its objects, as it would under DDP: the scheduler's position
# (the script steps it) and the flag torch's step wrapper sets on every optimizer.step() (the engine sets it
# for the steps it makes, so the scheduler does not warn that it was stepped before the optimizer).
TRAINING_STATE = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_opt_called",
                  "_is_initial"}


def _torch_namespaces() -> dict[str, object]:
    import torch
    import torch.distributed
    import torch.nn.utils
    import torch.nn.utils.clip_grad
    import torch.optim.lr_scheduler

    return {"torch": torch, "torch.nn.utils": torch.nn.utils, "torch.nn.utils.clip_grad": torch.nn.utils.clip_grad,
            "torch.optim.lr_scheduler": torch.optim.lr_scheduler, "torch.distributed": torch.distributed,
            "torch.nn.Module": torch.nn.Module, "torch.optim.Optimizer": torch.optim.Optimizer,
            "torch.optim.lr_scheduler.LRScheduler": torch.optim.lr_scheduler.LRScheduler}


def _record(objects: dict[str, object]) -> dict[str, dict[str, object]]:
    """Per object: its class, every entry of its `__dict__` (a module's or class's namespace) and what each of its
    dicts holds (a module's hooks live in dicts that stay the same objects as hooks come and go)."""
    return {label: {"type()": type(obj), "__class__": obj.__class__, **dict(vars(obj)), **_dict_contents(obj)}
            for label, obj in objects.items()}


def _dict_contents(obj: object) -> dict[str, object]:
    """`name[...]` -> the entries of each dict attribute (a parameter's gradient hooks included), as a tuple."""
    import torch

    if not isinstance(obj, (torch.nn.Module, torch.Tensor)):
        return {}
    dicts = {name: value for name, value in vars(obj).items() if isinstance(value, dict) and name != "_modules"}
    if isinstance(obj, torch.Tensor):  # None until a hook is first registered, an empty dict once it is removed
        dicts["_post_accumulate_grad_hooks"] = obj._post_accumulate_grad_hooks or {}
    return {f"{name}[...]": _Entries(tuple(value.items())) for name, value in dicts.items()}


class _Entries(tuple):
    """A dict's entries, compared by what they are (`_differences` compares other values by identity)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, tuple) and len(self) == len(other) and all(
            a[0] == b[0] and a[1] is b[1] for a, b in zip(self, other))

    __hash__ = tuple.__hash__


def _differences(before: dict[str, dict[str, object]], after: dict[str, dict[str, object]]) -> list[str]:
    found = []
    for label, entries in before.items():
        now = after[label]
        for name, value in entries.items():
            if name in TRAINING_STATE:
                continue
            if name not in now:
                found.append(f"{label}.{name}: removed")
            elif (now[name] != value) if isinstance(value, _Entries) else (now[name] is not value):
                found.append(f"{label}.{name}: {value!r} is now {now[name]!r}")
        for name in now.keys() - entries.keys() - TRAINING_STATE:
            if not isinstance(now[name], types.ModuleType):  # a submodule imported lazily is the import system's
                found.append(f"{label}.{name}: added ({now[name]!r})")
    return found


def _objects(model, optimizer, schedule) -> dict[str, object]:
    objects: dict[str, object] = dict(_torch_namespaces())
    objects.update({f"model.{name or '<root>'}": module for name, module in model.named_modules()})
    objects.update({f"parameter {name}": param for name, param in model.named_parameters()})
    objects.update({"optimizer": optimizer, "scheduler": schedule})
    return objects


def _build_train_end(rank: int, world_size: int, stage: int, end: str) -> dict:
    import gc

    import torch

    import zerorun
    import zerorun.runtime.engine  # noqa: F401 - what the engine imports is imported before the record
    from tests.runtime.reference import OPT, batch, make_model
    from zerorun import config

    recipe = config.loads("script: t.py\n", "t.yaml", [f"zero.stage={stage}", "zero.overlap_publish=true",
                                                        "zero.bucket_mb=0.0005"])
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    original_clip, original_class = torch.nn.utils.clip_grad_norm_, type(model)
    original_all_gather = torch.distributed.all_gather
    before = _record(_objects(model, optimizer, schedule))

    engine = zerorun.initialize(model, optimizer, recipe)
    on = {"clip routed": torch.nn.utils.clip_grad_norm_ is not original_clip,
          "root guarded": stage == 3 or type(model) is not original_class,
          "optimizer refuses": "zero_grad" in vars(optimizer),
          "collectives guarded": torch.distributed.all_gather is not original_all_gather}
    for micro in range(2):
        engine.backward(engine(batch(0, rank, micro)))
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        engine.step()
        schedule.step()
    on["clip reached the engine"] = norm == pytest.approx(engine.grad_norm)
    if end == "destroy":
        engine.destroy()
    del engine
    gc.collect()  # "collected": the engine's garbage collection undoes what destroy() would
    return {"on": on, "differences": _differences(before, _record(_objects(model, optimizer, schedule)))}


@pytest.mark.parametrize("stage,end", [(2, "destroy"), (3, "destroy"), (1, "collected")])
def test_nothing_of_torch_or_of_the_scripts_objects_differs_after_the_engine_is_gone(stage: int, end: str) -> None:
    for result in run_ranks(_build_train_end, 2, (stage, end)):
        assert all(result["on"].values()), f"an interception was not on while the engine lived: {result['on']}"
        assert result["differences"] == []


def _communicating_optimizer(rank: int, world_size: int, stage: int, overlap: bool) -> str:
    import torch
    import torch.distributed as dist

    import zerorun
    from tests.runtime.reference import batch, make_model
    from zerorun import config
    from zerorun.errors import ZerorunError

    class SpreadsItsOwnWork(torch.optim.Optimizer):  # as Keller Jordan's distributed Muon: a collective in step()
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    dist.all_reduce(p.grad)
                    p.add_(p.grad, alpha=-group["lr"])

    model = make_model(0)
    under_the_backward = ["zero.offload_optimizer=cpu", "zero.overlap_optimizer=true"] if overlap else []
    engine = zerorun.initialize(model, SpreadsItsOwnWork(model.parameters()),
                                config.loads("script: t.py\n", "t.yaml", [f"zero.stage={stage}", *under_the_backward]))
    engine.backward(engine(batch(0, rank, 0)))
    try:
        engine.step()
    except ZerorunError as refused:
        message = str(refused)
    else:
        message = "stepped"
    dist.all_reduce(torch.ones(1))  # outside the engine's step, the script's collectives are its own
    engine.destroy()
    return message


@pytest.mark.parametrize("stage, overlap", [(0, False), (3, False), (3, True)])  # True: stepped on the overlap's worker
def test_an_optimizer_that_communicates_inside_its_step_is_refused_before_the_collective_runs(stage: int,
                                                                                             overlap: bool) -> None:
    for message in run_ranks(_communicating_optimizer, 2, (stage, overlap)):
        assert message.startswith("SpreadsItsOwnWork.step() called torch.distributed.all_reduce while zerorun "
                                  "stepped it"), message
        assert "SingleDeviceMuonWithAuxAdam" in message


def _two_engines(rank: int, world_size: int) -> dict:
    import torch

    import zerorun
    from tests.runtime.reference import OPT, make_model
    from zerorun import config
    from zerorun.runtime.interop import clip_functions

    recipe = config.loads("script: t.py\n", "t.yaml", ["zero.stage=2", "zero.overlap_publish=true"])
    model = make_model(0)
    original = type(model)
    first = zerorun.initialize(model, torch.optim.AdamW(model.parameters(), **OPT), recipe)
    second = zerorun.initialize(model, None, recipe)
    owner = clip_functions.engine_of(list(model.parameters()))
    guarded_once = type(model).__mro__[1] is original
    second.destroy()
    return {"first removed": not first.interop.installed, "owner is second": owner is second,
            "guarded once": guarded_once, "class back": type(model) is original}


def test_a_second_engine_over_the_same_model_takes_over_the_first_ones_interceptions() -> None:
    for result in run_ranks(_two_engines, 2):
        assert all(result.values()), result


def test_the_parameter_guard_waits_keeps_the_class_leaves_copies_plain_and_goes_with_its_engine() -> None:
    import copy
    import io
    import pickle

    import torch
    from torch import nn

    from zerorun.runtime.interop.publish_guard import guard_parameter_reads

    class Owner:
        waits = 0

        def wait_all(self) -> None:
            self.waits += 1

    model, owner = nn.Sequential(nn.Linear(2, 2)), Owner()
    remove = guard_parameter_reads(model, owner.wait_all)
    list(model.parameters())
    dict(model.named_parameters())
    assert owner.waits == 2
    assert isinstance(model, nn.Sequential) and type(model).__name__ == "Sequential"
    assert type(copy.deepcopy(model)) is nn.Sequential  # AveragedModel's copy: no guard, no owner
    assert type(pickle.loads(pickle.dumps(model))) is nn.Sequential
    torch.save(model, io.BytesIO())
    list(model[0].parameters())  # a submodule is not guarded (documented: wait_published)
    assert owner.waits == 2
    remove()
    assert type(model) is nn.Sequential
    list(model.parameters())
    assert owner.waits == 2


def _failed_build(rank: int, world_size: int) -> list[str]:
    import torch

    import zerorun
    from tests.runtime.reference import OPT, make_model
    from zerorun import config
    from zerorun.errors import ZerorunError

    recipe = config.loads("script: t.py\n", "t.yaml", ["zero.stage=2", "zero.overlap_publish=true"])
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.parameters(), **OPT)
    elsewhere = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(make_model(1).parameters()), lambda step: 1.0)
    before = _record(_objects(model, optimizer, elsewhere))
    with pytest.raises(ZerorunError, match="another optimizer") as refused:
        zerorun.initialize(model, optimizer, recipe, lr_scheduler=elsewhere)
    differences = _differences(before, _record(_objects(model, optimizer, elsewhere)))
    del refused  # its traceback kept the half-built engine alive until now, as a script's handler may
    return differences


def test_an_engine_that_fails_to_build_changes_nothing() -> None:
    """The interceptions are installed last, so a refusal at initialize leaves torch and the script's objects
    as they were (not only once the half-built engine is garbage-collected)."""
    assert run_ranks(_failed_build, 2) == [[], []]


def _ddp_outlives_its_group(rank: int, world: int) -> tuple[int, int]:
    """A script's DDP model outlives its own destroy_process_group(), under the worker's hold: the threads of the
    process once the script's objects are freed, and once the hold is released."""
    import gc
    import os

    import torch
    import torch.distributed as dist

    from zerorun.runtime.comm.dist import init_distributed
    from zerorun.runtime.interop import process_group

    init_distributed()
    release = process_group.hold()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()  # the wrapper: the DDP's Reducer now holds the group in C++
    del model
    gc.collect()
    freed = len(os.listdir("/proc/self/task"))
    release()
    return freed, len(os.listdir("/proc/self/task"))


def test_a_group_the_script_destroyed_ends_when_the_worker_lets_go_not_inside_its_ddps_free() -> None:
    """torch frees DDP's Reducer with the GIL held; if it held the destroyed group's last reference, gloo's destructor
    would join a worker thread that may wait for the GIL (a hang at the rank's end). The destroyed group is held
    until the worker's release: gloo's threads live past the DDP's free and end with the release."""
    for freed, released in run_ranks(_ddp_outlives_its_group, 2):
        assert freed > released, (freed, released)
