"""Offload traffic statistics count a copy's own duration, not the launch of an asynchronous one."""

from __future__ import annotations

from zerorun.runtime.transfers import TransferStats


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
