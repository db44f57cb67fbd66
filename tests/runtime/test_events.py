"""What one optimizer step's window counts for telemetry."""

from __future__ import annotations

import torch

from zerorun.runtime.events import StepWindow


def test_forwards_under_no_grad_are_not_counted_as_training_throughput() -> None:
    window = StepWindow()
    tokens = torch.zeros(4, 9, dtype=torch.long)
    window.count_inputs((tokens,), {}, None)
    with torch.no_grad():  # a validation pass between steps, or sampling
        window.count_inputs((tokens,), {}, None)
    assert (window.samples, window.tokens) == (4, 36)
