"""The fp16 loss scaler: grows after `growth_interval` clean steps, backs off on overflow (never below
`min_loss_scale`), restarts its count after an overflow, and round-trips through its state dict."""

from __future__ import annotations

import torch

from zerorun import config
from zerorun.runtime.precision import LossScaler, PrecisionPolicy


def _scaler(dtype: str = "fp16", **keys: float) -> LossScaler:
    overrides = [f"precision.dtype={dtype}", *(f"precision.{k}={v}" for k, v in keys.items())]
    return LossScaler(config.loads("script: t.py", "t.yaml", overrides).precision)


def test_the_scale_grows_after_an_interval_of_clean_steps_and_backs_off_on_overflow() -> None:
    scaler = _scaler(initial_loss_scale=64, growth_interval=3, growth_factor=2, backoff_factor=0.25)
    seen = []
    for overflow in (False, False, True, False, False, False, False, False, False):
        scaler.update(overflow)
        seen.append(scaler.scale)
    # two clean steps are not enough; the overflow restarts the count; then every third clean step grows
    assert seen == [64, 64, 16, 16, 16, 32, 32, 32, 64]


def test_backoff_stops_at_the_minimum_scale() -> None:
    scaler = _scaler(initial_loss_scale=8, backoff_factor=0.5, min_loss_scale=2)
    for _ in range(5):
        scaler.update(True)
    assert scaler.scale == 2


def test_state_dict_round_trip_keeps_the_count_towards_growth() -> None:
    scaler = _scaler(initial_loss_scale=16, growth_interval=3)
    scaler.update(False)
    scaler.update(False)
    restored = _scaler(initial_loss_scale=1024, growth_interval=3)
    restored.load_state_dict(scaler.state_dict())
    restored.update(False)  # the third clean step since the last change
    assert restored.scale == 32


def test_bf16_and_fp32_never_scale() -> None:
    for dtype in ("bf16", "fp32"):
        scaler = _scaler(dtype)
        scaler.update(True)
        assert scaler.scale == 1.0 and not scaler.dynamic


def test_the_policy_keeps_master_and_reductions_in_fp32() -> None:
    for dtype, param in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = PrecisionPolicy.from_config(config.loads("script: t.py", "t.yaml", [f"precision.dtype={dtype}"]).precision)
        assert (policy.param_dtype, policy.reduce_dtype, policy.master_dtype) == (param, torch.float32, torch.float32)
