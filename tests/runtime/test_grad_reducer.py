"""The gradient reducer, without a process group: which unit it launches when, what it reduces, and
that it never holds more than a bounded number of reductions in flight.

A fake `Collectives` plays rank 0 of 2 whose peer contributed the same gradients (so a reduced
piece is twice this rank's), and counts unfinished reductions. Gradients arrive in a chosen order:
one `backward()` per parameter, each firing that parameter's post-accumulate-grad hook.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from zerorun.errors import ZerorunError
from zerorun.runtime.grad_reducer import MAX_INFLIGHT, GradReducer, LaunchOrder, Reduction
from zerorun.runtime.phase import Phase, TrainingPhase
from zerorun.runtime.units import cut_units, group_numels

SIZE = 3  # elements per parameter


class _Handle:
    def __init__(self, comm: _FakeComm, then) -> None:
        self.comm, self.then, self.done = comm, then, False
        self.ready = comm.finishes_at_once  # True: a transfer done before the call returned (shared memory)
        comm.outstanding += 1

    def wait(self) -> None:
        if not self.done:
            self.then()
            self.done = True
            self.comm.outstanding -= 1


class _FakeComm:
    rank, world_size = 0, 2

    def __init__(self, finishes_at_once: bool = False) -> None:
        self.outstanding = 0
        self.kinds: list[str] = []
        self.finishes_at_once = finishes_at_once

    def all_reduce(self, tensor: torch.Tensor, unit: int = -1) -> _Handle:
        self.kinds.append("all_reduce")
        return _Handle(self, lambda: tensor.mul_(2))

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool = False,
                       unit: int = -1, used: object = None) -> _Handle:
        self.kinds.append("reduce_scatter")
        piece = 2 * full[:out.numel()]  # rank 0's piece, summed with an identical peer

        def finish() -> None:
            out.add_(piece) if accumulate else out.copy_(piece)
        return _Handle(self, finish)


def _setup(reduction: Reduction, order: LaunchOrder, overlap: bool = True, params: int = 4):
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(SIZE)) for _ in range(params)]
    units = cut_units(0, weights, bucket_numel=1, world=2, dtype=torch.float32, flat_offset=0)  # one unit each
    store = SimpleNamespace(units=units, group_numels=group_numels(units, 1), shard_rank=0)
    comm, phase, launched, inflight = _FakeComm(), TrainingPhase(), [], []

    reducer = GradReducer(store, comm, torch.float32, torch.device("cpu"), reduction, order, overlap, phase)
    launch = reducer._launch

    def spied(k: int) -> None:  # every launch, the reducer's own or a caller's, and what was in flight after it
        launch(k)
        launched.append(k)
        inflight.append(comm.outstanding)
    reducer._launch = spied
    if order is LaunchOrder.READY:
        _hook_like_stage3(reducer, weights)
    return SimpleNamespace(weights=weights, reducer=reducer, comm=comm, phase=phase, launched=launched,
                           inflight=inflight)


def _hook_like_stage3(reducer: GradReducer, weights: list[nn.Parameter]) -> None:
    """What stage 3's unit groups do with a `READY` reducer (unit_group.py): hand each gradient over, launch a
    unit it completes."""
    def arrived(param: nn.Parameter) -> None:
        k = reducer.accept(param)
        if k is not None and reducer.launches_now(k):
            reducer.launch(k)
    for weight in weights:
        weight.register_post_accumulate_grad_hook(arrived)


def _backward(t, arrival: list[int], reduce: bool = True, scale: float = 1.0) -> list[int]:
    """Gradients `scale * (k + 1)` for the parameters in `arrival` order; returns the launches seen during backward."""
    with t.phase.running(Phase.BACKWARD):
        t.reducer.begin_backward(reduce=reduce)
        for k in arrival:
            (t.weights[k] * scale * (k + 1)).sum().backward()
        during = list(t.launched)
        t.reducer.end_backward()
    return during


def _shard_values(t, k: int) -> list[float]:
    return t.reducer.grad_pieces(0)[k][:SIZE].tolist()


def test_stages_0_to_2_launch_in_layout_order_whatever_order_hooks_fire() -> None:
    t = _setup(Reduction.SCATTER_SHARD, LaunchOrder.LAYOUT)
    assert _backward(t, [2, 0, 3, 1]) == [0, 1, 2, 3]
    assert t.reducer.overlapped_launches == 4  # every unit went out while backward ran
    assert [_shard_values(t, k) for k in range(4)] == [[2.0 * (k + 1)] * SIZE for k in range(4)]


def test_stage3_launches_each_unit_as_soon_as_it_is_complete() -> None:
    t = _setup(Reduction.SCATTER_SHARD, LaunchOrder.READY)
    assert _backward(t, [2, 0, 3, 1]) == [2, 0, 3, 1]


def test_an_unused_parameter_is_reduced_with_zeros_after_backward() -> None:
    t = _setup(Reduction.SCATTER_SHARD, LaunchOrder.LAYOUT)
    _backward(t, [0, 1, 2])
    _backward(t, [0, 1, 2])  # its pooled staging buffer held the others' gradients: still zeros
    assert t.launched[-1] == 3 and _shard_values(t, 3) == [0.0] * SIZE
    assert _shard_values(t, 0) == [4.0] * SIZE  # two micro-steps accumulated into the shard


def test_without_overlap_every_unit_is_reduced_after_backward() -> None:
    t = _setup(Reduction.SCATTER_SHARD, LaunchOrder.LAYOUT, overlap=False)
    assert _backward(t, [3, 2, 1, 0]) == [] and t.launched == [0, 1, 2, 3]
    assert t.reducer.overlapped_launches == 0


@pytest.mark.parametrize("reduction, kind", [(Reduction.ALL_REDUCE, "all_reduce"),
                                             (Reduction.SCATTER_FULL, "reduce_scatter")])
def test_stages_0_and_1_accumulate_locally_and_reduce_once_at_the_boundary(reduction: Reduction, kind: str) -> None:
    t = _setup(reduction, LaunchOrder.LAYOUT)
    _backward(t, [3, 2, 1, 0], reduce=False)
    assert t.launched == [] and t.comm.kinds == []
    _backward(t, [3, 2, 1, 0], reduce=True, scale=0.5)
    assert t.launched == [0, 1, 2, 3] and set(t.comm.kinds) == {kind}
    assert [_shard_values(t, k) for k in range(4)] == [[3.0 * (k + 1)] * SIZE for k in range(4)]  # 2 x 1.5


@pytest.mark.parametrize("reduction", list(Reduction))
def test_a_new_window_overwrites_the_last_ones_gradients_and_an_unused_parameter_reads_zero(
        reduction: Reduction) -> None:
    """`zero()` clears nothing: the window's first write overwrites, and a parameter with no gradient in the
    window is zeroed when its unit is reduced (the buffers still hold the last window's sums)."""
    t = _setup(reduction, LaunchOrder.LAYOUT)
    _backward(t, [3, 2, 1, 0])
    t.reducer.zero()
    _backward(t, [2, 1, 0], scale=0.5)
    assert [_shard_values(t, k) for k in range(4)] == [[1.0 * (k + 1)] * SIZE for k in range(3)] + [[0.0] * SIZE]
    t.reducer.zero()
    _backward(t, [3], reduce=reduction is Reduction.SCATTER_SHARD)  # accumulation micro-steps, then the boundary
    _backward(t, [3, 0])
    assert [_shard_values(t, k) for k in (0, 1, 3)] == [[2.0] * SIZE, [0.0] * SIZE, [16.0] * SIZE]


def test_reductions_in_flight_stay_bounded() -> None:
    t = _setup(Reduction.SCATTER_SHARD, LaunchOrder.READY, params=7)
    _backward(t, list(range(7)))
    assert max(t.inflight) <= MAX_INFLIGHT and t.comm.outstanding == 0


def test_a_gradient_outside_engine_backward_is_refused() -> None:
    t = _setup(Reduction.SCATTER_SHARD, LaunchOrder.LAYOUT)
    with pytest.raises(ZerorunError, match=r"call engine.backward\(loss\), not loss.backward\(\)"):
        t.weights[0].sum().backward()


def _one_unit(sizes: list[int], finishes_at_once: bool = False):
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(n)) for n in sizes]
    units = cut_units(0, weights, bucket_numel=10**6, world=2, dtype=torch.float32, flat_offset=0)
    store = SimpleNamespace(units=units, group_numels=group_numels(units, 1), shard_rank=0)
    comm, phase = _FakeComm(finishes_at_once), TrainingPhase()
    reducer = GradReducer(store, comm, torch.float32, torch.device("cpu"), Reduction.SCATTER_SHARD,
                          LaunchOrder.READY, True, phase)
    _hook_like_stage3(reducer, weights)
    return weights, reducer, phase


def test_a_units_first_small_gradients_are_held_so_it_takes_a_staging_buffer_only_at_the_end() -> None:
    weights, reducer, phase = _one_unit([10, 8, 1000])  # e.g. stage 3's root: a norm first, the embedding last
    with phase.running(Phase.BACKWARD):
        reducer.begin_backward(reduce=True)
        for i in (0, 1):
            (weights[i] * (i + 1)).sum().backward()
        assert reducer.pool.allocated_bytes == 0 and not reducer._staging  # 18 of 1018 elements: held
        (weights[2] * 3).sum().backward()  # completes the unit: staged with what was held, and reduced
        reducer.end_backward()
    piece = reducer.grad_pieces(0)[0]  # rank 0's half of the unit: the first 509 elements, summed over 2 ranks
    assert piece[:10].tolist() == [2.0] * 10 and piece[10:18].tolist() == [4.0] * 8
    assert piece[18:509].tolist() == [6.0] * 491


def test_held_gradients_are_staged_once_they_make_up_half_the_unit() -> None:
    weights, reducer, phase = _one_unit([10, 600, 400])
    with phase.running(Phase.BACKWARD):
        reducer.begin_backward(reduce=True)
        weights[0].sum().backward()
        assert not reducer._staging
        weights[1].sum().backward()  # 610 of 1010 elements: staged now, before the unit is complete
        assert list(reducer._staging) == [0]
        weights[2].sum().backward()
        reducer.end_backward()
    assert set(reducer.grad_pieces(0)[0].tolist()) == {2.0}  # rank 0's half: parameters 0 and 1, summed


def test_a_transfer_done_at_once_gives_its_staging_buffer_back_at_once_one_buffer_in_all() -> None:
    t = _setup(Reduction.SCATTER_SHARD, LaunchOrder.READY)
    t.comm.finishes_at_once = True
    _backward(t, [3, 2, 1, 0])
    assert t.reducer.pool.peak_bytes == t.reducer.units[0].padded_numel * 4  # one buffer served all four
    assert t.reducer.pool.allocated_bytes == 0  # and went back to the allocator at the end of the backward
    assert [_shard_values(t, k) for k in range(4)] == [[2.0 * (k + 1)] * SIZE for k in range(4)]
