"""The accumulation window: what the script did since the last update, checked against the recipe.

zerorun counts micro-batches by `engine.step()` calls: with `train.grad_accum_steps: N` the script
calls `engine.backward(loss)` and `engine.step()` for every micro-batch, and every N-th step
updates. A loop brought from DDP calls `backward(loss / N)` per micro-batch and steps once per
window; under the recipe's accumulation that would update N times less often and divide the loss
twice, and at stages 0-1 a second reducing backward in one window would sum gradients across
ranks twice. Both train the wrong thing without an error, so they are refused at the first
window, before any update, naming the two ways to write the loop:

1. zerorun's: `engine.backward(loss); engine.step()` for every micro-batch, the loss undivided.
2. the script's own: `train.grad_accum_steps: 1`, several `engine.backward(loss / N)` per
   `engine.step()`, all but the last inside `with engine.no_sync():` (as DDP's `no_sync`; needed at
   stages 0-1, where gradients are reduced once per window; stages 2-3 reduce every micro-batch).
"""

from __future__ import annotations

from zerorun.errors import ZerorunError

TWO_WAYS = ("write the loop one of two ways: (1) engine.backward(loss) and engine.step() for every micro-batch, "
            "without dividing the loss (the engine divides by train.grad_accum_steps and updates at the end of "
            "each window; engine.is_boundary tells when), or (2) set train.grad_accum_steps: 1 and keep your loop "
            "of several engine.backward(loss / N) per engine.step(), with all but the last inside "
            "`with engine.no_sync():` (needed at stages 0-1).")


class AccumulationWindow:
    """Backward passes and reductions since the last update, and since the last `engine.step()` call."""

    def __init__(self) -> None:
        self.unsynced = False  # inside `engine.no_sync()`
        self.reset()

    def reset(self) -> None:
        """A new window: after an update, or `engine.zero_grad()`."""
        self.backwards = 0  # backward passes in this window
        self.reduced = False  # a backward of this window reduced its gradients across ranks
        self.backwards_since_step = 0

    def check_backward(self, accum: int, stage: int, accum_given_at: str | None) -> None:
        """Refuse a second backward before `engine.step()` where it would train the wrong thing."""
        if not self.backwards_since_step:
            return
        if accum > 1:
            where = f" ({accum_given_at})" if accum_given_at else ""
            raise ZerorunError(
                f"engine.backward() called again before engine.step(), while the recipe accumulates "
                f"gradients (train.grad_accum_steps: {accum}{where}): zerorun counts micro-batches by engine.step() "
                f"calls, so this loop would update {accum}x less often and divide the loss twice. " + TWO_WAYS)
        if stage < 2 and self.reduced:
            raise ZerorunError(
                f"engine.backward() called again before engine.step() after a backward that reduced gradients "
                f"across ranks: at stage {stage} a window's gradients are reduced once, so this would count the "
                f"first micro-batches twice. Put every backward but the window's last inside "
                f"`with engine.no_sync():`, or " + TWO_WAYS[len("write the loop "):])

    def backward_started(self, reduces: bool) -> None:
        self.backwards += 1
        self.backwards_since_step += 1
        self.reduced = self.reduced or reduces

    def check_step(self, boundary: bool, stage: int) -> None:
        """At the end of a window, stages 0-1 must have reduced its gradients (the last backward, outside no_sync)."""
        self.backwards_since_step = 0
        if boundary and stage < 2 and self.backwards and not self.reduced:
            raise ZerorunError(
                "engine.step() ends an accumulation window whose gradients were never reduced across ranks: its "
                "last engine.backward() ran inside engine.no_sync(), so each rank would update with its own "
                "gradients only. Run the window's last backward outside no_sync().")

    def complete(self, boundary: bool) -> bool:
        """Whether the window's gradients are all reduced: its last backward ran and reduced them."""
        return boundary and self.reduced and self.backwards_since_step > 0
