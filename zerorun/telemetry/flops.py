"""Model FLOPs and device peaks, for model TFLOP/s and MFU.

Model FLOPs count the arithmetic the model needs, not what the hardware did (recomputation,
padding and optimizer math do not count), so MFU compares setups fairly:
- transformers: 6 x parameters x tokens per step (2 for the forward's multiply-adds, 4 for the
  backward's two matmuls per weight), the usual estimate (Kaplan et al. 2020, PaLM's MFU);
- anything else: a measured count, `count_training_flops(model, *example_inputs)` (torch's
  FlopCounterMode on one forward, times 3), given to the probe with `set_model_flops(per_sample=...)`.

Peaks are dense (no 2:4 sparsity) tensor-core figures from the vendors' data sheets for bf16/fp16;
fp32 uses the plain fp32 peak (with TF32 matmuls on, MFU reads high). CPUs have no peak here:
MFU is n/a unless the recipe sets `telemetry.peak_tflops`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (substring of torch.cuda.get_device_name, bf16/fp16 dense TFLOP/s, fp32 TFLOP/s); first match wins,
# so more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("GB200", 2500.0, 80.0),
    ("B200", 2250.0, 80.0),
    ("B100", 1750.0, 60.0),
    ("H200", 989.0, 67.0),
    ("GH200", 989.0, 67.0),
    ("H100 PCIe", 756.0, 51.0),
    ("H100 NVL", 835.0, 60.0),
    ("H100", 989.0, 67.0),
    ("H800", 989.0, 67.0),
    ("A100", 312.0, 19.5),
    ("A800", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L40", 181.0, 90.5),
    ("L4", 121.0, 30.3),
    ("A10G", 70.0, 31.2),
    ("A10", 125.0, 31.2),
    ("V100", 125.0, 15.7),  # fp16 only: V100 has no bf16
    ("MI300X", 1307.0, 163.4),
    ("MI250X", 383.0, 47.9),
)


def peak_tflops(device_name: str | None, dtype: str) -> float | None:
    """The dense peak TFLOP/s of one device for `dtype` (fp32/bf16/fp16); None when unknown (CPUs)."""
    if not device_name:
        return None
    for needle, half, single in PEAK_TFLOPS:
        if needle.lower() in device_name.lower():
            return single if dtype == "fp32" else half
    return None


@dataclass
class ModelFlops:
    """FLOPs of one training step (forward + backward) of the model, per token or per sample."""

    params: int
    per_token: float | None = None  # default: 6 x params
    per_sample: float | None = None  # used when the inputs are not tokens (or when the script says so)

    def __post_init__(self) -> None:
        if self.per_token is None and self.per_sample is None:
            self.per_token = 6.0 * self.params

    def step_flops(self, tokens: int, samples: int) -> float | None:
        if self.per_sample is not None:
            return self.per_sample * samples
        if self.per_token is not None and tokens > 0:
            return self.per_token * tokens
        return None


def count_training_flops(model: Any, *example_inputs: Any, **example_kwargs: Any) -> float:
    """Measured FLOPs of one training step on these inputs: one forward, counted by torch, times 3.

    Divide by the batch size for `set_model_flops(per_sample=...)`.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*example_inputs, **example_kwargs)
    return 3.0 * counter.get_total_flops()
