"""A node that drops off the network, for real: its link goes down mid-run (a pulled cable, not a killed client).

Nothing tells either side: no FIN, no RST, the ssh connection just goes quiet. The launcher must
notice the silence (no heartbeat), drop the node under `shrink` and finish on the other with the
global batch kept; the cut-off node must notice the launcher's silence too and end its own workers,
so that nothing is left running on it once the link comes back.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from zerorun.bench.cluster import IFACE

pytestmark = pytest.mark.slow  # emulated nodes, an sshd on each

SCRIPT = "train_restartable.py"
STEPS = 8


def _link(namespace: str, state: str) -> None:
    subprocess.run(["ip", "-n", namespace, "link", "set", IFACE, state], check=True)


def test_a_node_whose_link_goes_down_is_dropped_and_ends_its_own_workers(cluster, launch_on_cluster, tmp_path: Path):
    lost = cluster.nodes[1]
    job = launch_on_cluster(SCRIPT, ["--hold-at", "6", "--hold-world", "2"], nproc=1,
                            train={"steps": STEPS, "micro_batch_size": 4},
                            checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 2},
                            launch={"kill_grace_s": 1.0, "transport": "ssh", "max_restarts": 1,
                                    "on_node_failure": "shrink"},
                            telemetry={"interval_s": 0.2})
    try:
        job.wait_until(lambda: any("rank 1 holds before step 6" in line for line in job.stdout),
                       "the second node holding before step 6", timeout=240)
        _link(lost.namespace, "down")
        assert job.wait(timeout=300) == 0, job.output
        stderr = "\n".join(job.stderr)
        assert re.search(rf"lost contact with {lost.address}: no heartbeat for \d+ s", stderr), job.output
        assert (f"zerorun: restart 1 of 1 without {lost.address}: 2 -> 1 nodes, 2 -> 1 ranks; global batch 8 "
                "kept: train.micro_batch_size 4, train.grad_accum_steps 1 -> 2") in stderr, job.output
        first = cluster.nodes[0].address
        assert f"[{first}:0] rank 0 resumed from step-6 at step 6" in job.stdout, job.output
        assert [line for line in job.stdout if " step 7 loss" in line][-1].startswith(f"[{first}:0] rank 0 step 7")
        # the cut-off node heard no heartbeat either: its supervisor ends its workers by itself
        deadline = time.monotonic() + 60
        while job.leftovers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job.leftovers() == [], [p.cmdline() for p in job.leftovers()]
    finally:
        _link(lost.namespace, "up")
