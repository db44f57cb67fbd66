"""Which frames count as a wait for other ranks: the stall report's "behind: rank N" rests on it.

The split of handles.py out of collectives.py once left a rank blocked in `Handle.wait` looking busy in
threading.py, and the report named no rank behind (only the slow launch tests noticed).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed

import zerorun
from zerorun.telemetry import whereabouts

COMM = Path(zerorun.__file__).parent / "runtime" / "comm"


def test_every_module_of_zeroruns_comm_and_torch_distributed_is_a_collective_wait() -> None:
    modules = sorted(COMM.glob("*.py"))
    assert len(modules) > 3
    assert all(whereabouts.in_collective_file(str(path)) for path in modules)
    assert whereabouts.in_collective_file(torch.distributed.__file__)


def test_the_engine_and_the_script_are_not() -> None:
    engine = Path(zerorun.__file__).parent / "runtime" / "engine.py"
    assert not whereabouts.in_collective_file(str(engine))
    assert not whereabouts.in_collective_file(__file__)
