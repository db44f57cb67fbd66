"""The fp16 loss scaler: growth, backoff, DeepSpeed's hysteresis and a static scale."""

from __future__ import annotations

from zerorun import config
from zerorun.runtime.precision import LossScaler


def _scaler(**precision: object) -> LossScaler:
    return LossScaler(config.from_dict({"script": "t.py", "precision": {"dtype": "fp16", **precision}}).precision)


def _run(scaler: LossScaler, overflows: str) -> list[float]:
    """The scale after each step; `overflows` is a string of 'x' (overflow) and '.' (clean step)."""
    out = []
    for mark in overflows:
        scaler.update(mark == "x")
        out.append(scaler.scale)
    return out


def test_without_hysteresis_every_overflow_halves_and_a_clean_window_doubles() -> None:
    scaler = _scaler(initial_loss_scale=64, growth_interval=2)
    assert _run(scaler, "x..x.x..") == [32, 32, 64, 32, 32, 16, 16, 32]


def test_hysteresis_lets_overflows_in_a_row_pass_until_the_count_is_spent() -> None:
    # DeepSpeed's delayed shift 2: the first overflow only spends the count, the second backs off; the
    # count refills when the scale grows (not after a clean step, without consecutive_hysteresis).
    scaler = _scaler(initial_loss_scale=64, growth_interval=3, hysteresis=2)
    assert _run(scaler, "x.x...x") == [64, 64, 32, 32, 32, 64, 64]
    consecutive = _scaler(initial_loss_scale=64, growth_interval=3, hysteresis=2, consecutive_hysteresis=True)
    assert _run(consecutive, "x.x.x") == [64, 64, 64, 64, 64]  # each clean step refills it


def test_a_static_scale_never_moves_and_min_loss_scale_bounds_backoff() -> None:
    assert _run(_scaler(initial_loss_scale=128, dynamic_loss_scale=False), "xx..x") == [128] * 5
    assert _run(_scaler(initial_loss_scale=4, min_loss_scale=2), "xxx") == [2, 2, 2]


def test_state_survives_a_round_trip_including_the_hysteresis_left() -> None:
    scaler = _scaler(initial_loss_scale=64, hysteresis=3)
    _run(scaler, "x")
    restored = _scaler(initial_loss_scale=64, hysteresis=3)
    restored.load_state_dict(scaler.state_dict())
    assert _run(restored, "xx") == [64, 32]  # one of three was spent before the save
