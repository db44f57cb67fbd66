"""`zero.quantized_*: auto` (runtime/comm/compression.py): int8 on the wire where the measured link and codec say it
pays, off where they say it does not, and off without measuring where nothing crosses a network."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from zerorun.runtime.comm.compression import Rates


def test_the_rule_turns_int8_on_over_a_slow_link_and_off_over_a_fast_one() -> None:
    """The emulated cluster's figures (docs/cluster.md): quantized stage 2 paid at 1 Gbit/s (0.12 GB/s per rank) and
    did not at 10 Gbit/s (1.2 GB/s), with the CPU codec at 3.1 GB/s to quantize and 16.5 GB/s to add back."""
    codec = 1 / 3.1e9 + 1 / 16.5e9
    assert Rates(link_s_per_byte=1 / 0.12e9, codec_s_per_byte=codec).pays
    assert not Rates(link_s_per_byte=1 / 1.2e9, codec_s_per_byte=codec).pays
    assert "would cost more than it saves" in Rates(1 / 1.2e9, codec).describe()


def _decided(rank: int, world: int, cpu: str, link_gb_s: float | None) -> tuple[bool, bool, str]:
    import logging

    from zerorun.runtime.comm import compression
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    measured = []
    if link_gb_s is not None:  # the rates as a slow or a fast link would give them, whatever this machine's are
        real = compression.measure

        def measure(network, device):  # noqa: ANN001, ANN202 - compression.measure's signature
            measured.append(real(network, device))  # the probe itself runs, as a collective
            return Rates(1 / (link_gb_s * 1e9), 1 / 3e9)
        compression.measure = measure
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zerorun").addHandler(handler)
    comm = Collectives(cpu=cpu, quantized_gradients="auto", quantized_weights="auto")
    assert all(r.link_s_per_byte > 0 and r.codec_s_per_byte > 0 for r in measured)
    return comm.quantized_gradients, comm.quantized_weights, " ".join(said)


@pytest.mark.parametrize("link_gb_s, on", [(0.12, True), (1.2, False)])
def test_auto_measures_over_the_network_and_decides_on_every_rank_alike(link_gb_s: float, on: bool) -> None:
    for rank, (gradients, weights, said) in enumerate(run_ranks(_decided, 2, ("gloo", link_gb_s))):
        assert gradients is weights is on
        if rank == 0:
            assert f"zero.quantized_gradients and quantized_weights: auto: {'on' if on else 'off'}" in said


def test_auto_stays_off_where_shared_memory_carries_everything() -> None:
    for rank, (gradients, weights, said) in enumerate(run_ranks(_decided, 2, ("shm", None))):
        assert not gradients and not weights
        if rank == 0:
            assert "nothing crosses a network" in said
