"""The offload staging ring: every tile's gradient and update pass through it intact, with as many
slots as the copies need; traffic statistics count a copy's own duration, not the launch of an
asynchronous one."""

from __future__ import annotations

import pytest
import torch

from zerorun.runtime.offload.transfers import StagingRing, TransferStats


@pytest.mark.parametrize("slots", [None, 2, 3])
def test_every_tile_passes_the_ring_intact_whatever_its_slots(slots: int | None) -> None:
    """None: a CPU-only machine's own choice (one slot each way, as nothing is in flight); 2 and 3
    rotate slots the way CUDA does, so that logic is checked here too."""
    ring = StagingRing(torch.device("cpu"), tile_numel=5, pin=False, slots=slots)
    assert ring.slots == (slots or 1) and ring.held_bytes() == ring.slots * 5 * (4 + 4)
    grads = torch.arange(23, dtype=torch.float32)
    tiles = [grads[lo:lo + 5] for lo in range(0, 23, 5)]  # the last one is short
    params = torch.zeros(23, dtype=torch.bfloat16)
    ring.begin(tiles)
    for k, tile in enumerate(tiles):
        staged_grad = ring.fetch(k)
        assert torch.equal(staged_grad, tile), k
        out = ring.out_slot(tile.numel(), torch.bfloat16)
        out.copy_(staged_grad * 2)  # the "update"
        ring.send(params[5 * k:5 * k + tile.numel()], out)
    ring.finish()
    assert torch.equal(params, (grads * 2).to(torch.bfloat16))
    stats = ring.stats()
    assert stats["d2h"]["bytes"] == 23 * 4 and stats["h2d"]["bytes"] == 23 * 2


class FakeEvent:
    """A CUDA timing event as TransferStats uses it: recorded at `t` seconds, passed or not."""

    def __init__(self, t: float, done: bool = True) -> None:
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "FakeEvent") -> float:
        return (other.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event does


def test_copy_seconds_come_from_events_once_the_copy_has_passed() -> None:
    stats = TransferStats()
    stats.bytes["d2h"] += 2 << 30
    first_end = FakeEvent(1.1)
    stats.pending.append(("d2h", FakeEvent(1.0), first_end))
    second_end = FakeEvent(1.35, done=False)  # still on the copy stream
    stats.pending.append(("d2h", FakeEvent(1.1), second_end))
    stats.pending.append(("h2d", FakeEvent(2.0), FakeEvent(2.5)))
    out = stats.as_dict()
    assert abs(out["d2h"]["seconds"] - 0.1) < 1e-9 and abs(out["h2d"]["seconds"] - 0.5) < 1e-9
    second_end.done = True
    assert abs(stats.as_dict()["d2h"]["seconds"] - 0.35) < 1e-9  # counted once, when it passed
    assert abs(stats.as_dict()["d2h"]["seconds"] - 0.35) < 1e-9 and not stats.pending
