"""How the engine finds the LR schedulers a script built on its optimizers (interop/schedulers.py): every one,
however it refers to the optimizer, and with one scan of the heap where no scheduler's __dict__ can be among
what refers to it (each scan reads every object the collector tracks: 30 ms in a process that imported torch)."""

from __future__ import annotations

import gc

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau, SequentialLR, StepLR

from zerorun.runtime.interop.schedulers import schedulers_of


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


def test_every_scheduler_is_found_through_its_dict_or_itself_and_a_sequences_children_are_left_out() -> None:
    opt = _optimizer()
    plain = LambdaLR(opt, lambda step: 1.0)
    read = StepLR(opt, step_size=2)
    read.state_dict()  # asks for its __dict__: from Python 3.11 the dict then refers to the optimizer, not the object
    plateau = ReduceLROnPlateau(opt)  # builds no LRScheduler base: found all the same
    first, second = LambdaLR(opt, lambda step: 0.5), StepLR(opt, step_size=3)
    sequence = SequentialLR(opt, [first, second], milestones=[2])
    found = schedulers_of([opt])
    assert {id(s) for s in found} == {id(plain), id(read), id(plateau), id(sequence)}, found
    assert schedulers_of([_optimizer()]) == []


def test_a_dict_that_is_no_schedulers_costs_no_second_scan(monkeypatch) -> None:
    opt = _optimizer()
    held = {"opt": opt, "optimizer_name": "sgd"}  # the script's own dict refers to the optimizer
    scans = []
    real = gc.get_referrers

    def counted(*objects: object) -> list:
        scans.append(len(objects))
        return real(*objects)

    monkeypatch.setattr(gc, "get_referrers", counted)
    assert schedulers_of([opt]) == []
    assert len(scans) == 1, scans
    del held
