"""The emulated cluster itself: nodes apart (hostname, address, /dev/shm), links shaped, nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from zerorun.bench import cluster as emulated

pytestmark = [pytest.mark.skipif(emulated.unavailable_reason() is not None,
                                 reason=str(emulated.unavailable_reason())),
              pytest.mark.slow]  # each builds network namespaces and shaped links


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_each_node_has_its_own_hostname_address_and_shared_memory(cluster):
    a, b = cluster.nodes
    assert [cluster.cluster.run_on(n, ["hostname"]).stdout.strip() for n in (a, b)] == ["node0", "node1"]
    made = cluster.cluster.run_on(a, ["sh", "-c", "touch /dev/shm/zrc-only-on-node0 && ls /dev/shm"])
    assert "zrc-only-on-node0" in made.stdout, made.stderr
    assert "zrc-only-on-node0" not in cluster.cluster.run_on(b, ["ls", "/dev/shm"]).stdout
    assert not Path("/dev/shm/zrc-only-on-node0").exists()  # nor on the machine itself
    cluster.cluster.run_on(a, ["rm", "/dev/shm/zrc-only-on-node0"])
    reached = cluster.ssh(a, b, "hostname")
    assert (reached.returncode, reached.stdout.strip()) == (0, "node1"), reached.stderr


def test_a_shaped_link_never_delivers_more_than_its_rate_in_either_direction(cluster):
    links = cluster.cluster.measure_links(seconds=1.0)
    assert [(link.source, link.destination) for link in links] == [("node0", "node1"), ("node1", "node0")]
    for link in links:  # unshaped, a veth pair carries several Gbit/s even on a loaded machine
        assert 0 < link.gbit_s <= 1.05, links


def test_a_star_of_three_nodes_reaches_every_node_and_stop_removes_everything():
    before = _namespaces()
    with emulated.EmulatedCluster.start(3, "10gbit") as star:
        # this process's only: another pytest worker may be starting a cluster of its own meanwhile
        created = {name for name in _namespaces() - before if name.startswith(f"{emulated.PREFIX}{os.getpid()}-")}
        assert created == {*star.namespaces, star.switch}
        holders = [node.holder_pid for node in star.nodes]
        for node in star.nodes:  # each node's uplink carries traffic through the bridge
            assert star.tx_bytes(node) >= 0
        assert all(link.gbit_s > 0 for link in star.measure_links(seconds=0.3))
    assert _namespaces() & created == set()
    assert not any(Path(f"/proc/{pid}").exists() and "sleep" in Path(f"/proc/{pid}/cmdline").read_text()
                   for pid in holders)
    star.stop()  # a second stop is harmless


def test_a_cluster_whose_owner_was_killed_is_swept_at_the_next_start(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from zerorun.bench.cluster import EmulatedCluster\n"
        "c = EmulatedCluster.start(2, '1gbit'); print(' '.join(c.namespaces), flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    left = owner.stdout.readline().split()
    owner.kill()  # no teardown at all: namespaces, the holders and their mounts stay behind
    owner.wait()
    assert len(left) == 2 and set(left) <= _namespaces()
    files = list(Path(tempfile.gettempdir()).glob(f"{left[0][:-2]}-*"))
    assert len(files) == 1  # the nodes' /etc/hosts
    swept = emulated.sweep_stale()
    assert set(left) <= set(swept)
    assert not set(left) & _namespaces() and not files[0].exists()

