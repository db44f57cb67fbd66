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


def _weights() -> torch.Tensor:
    return torch.arange(1.0, 7.0, requires_grad=True)


def test_the_loss_reported_is_the_one_the_forward_computed_however_the_script_scales_it() -> None:
    # Issue 57: with the guide's accumulation spelling, `engine.backward(loss / W)`, telemetry showed 1/W of the loss.
    w = _weights()
    scalings = {
        "loss / 4": lambda loss: loss / 4, "loss * 0.25": lambda loss: loss * 0.25,
        "0.25 * loss": lambda loss: 0.25 * loss, "loss / tensor(4)": lambda loss: loss / torch.tensor(4.0),
        "nanoGPT's port: (loss / 4) * 4": lambda loss: (loss / 4) * 4, "as is": lambda loss: loss,
        "bf16, cast back, / 4": lambda loss: loss.bfloat16().float() / 4,
    }
    for name, scaled in scalings.items():
        window = StepWindow()
        loss = (w * w).mean()  # 15.1666...
        window.note_outputs((torch.zeros(2, requires_grad=True) * 2, loss))  # (logits, loss), as nanoGPT's model
        window.add_loss(scaled(loss))
        assert abs(window._unscaled()[0].item() - loss.item()) < 0.1, (name, window._unscaled()[0].item())


def test_a_loss_not_a_scaling_of_the_forwards_is_reported_as_given() -> None:
    w = _weights()
    for name, given in {"a sum with another term": lambda loss: (loss + w.sum()) / 2,
                        "a constant divided by the loss": lambda loss: 1 / loss,
                        "computed outside the forward": lambda loss: (w * 3).mean() / 4}.items():
        window = StepWindow()
        loss = (w * w).mean()
        window.note_outputs(loss)
        value = given(loss)
        window.add_loss(value)
        assert window._unscaled()[0].item() == value.item(), name
    window = StepWindow()
    with torch.no_grad():  # an evaluation forward between steps: not the loss of the next backward
        window.note_outputs((w * w).mean())
    loss = (w * w).mean()
    window.add_loss(loss / 4)
    assert window._unscaled()[0].item() == (loss / 4).item()


def test_a_loss_computed_outside_the_forward_and_divided_by_the_window_is_reported_whole() -> None:
    # The guide's loop: logits = engine(x); loss = cross_entropy(logits, y); engine.backward(loss / W), W backwards.
    w = _weights()
    for window_size, divisor, reported in ((4, 4, "whole"), (2, 2, "whole"), (1, 2, "as given"), (4, 2, "as given")):
        window = StepWindow()
        losses = [(w * w).mean() + k for k in range(window_size)]
        for loss in losses:
            window.note_outputs(w * 2)  # logits: not a scalar
            window.add_loss(loss / divisor)
        want = [loss.item() if reported == "whole" else loss.item() / divisor for loss in losses]
        assert [t.item() for t in window._unscaled()] == want, (window_size, divisor)
