"""An emulated cluster on one machine: N nodes, each its own network namespace, hostname and /dev/shm.

    with EmulatedCluster.start(nodes=2, link="1gbit") as cluster:
        cluster.nodes[1].address             # "10.77.0.2"
        cluster.exec_argv(cluster.nodes[1])  # prefix a command with this to run it "on" node 1
        cluster.measure_links()              # each link's delivered throughput, by a socket benchmark

Every node is a holder process (`sleep infinity`) started in a fresh network namespace, with
`unshare --uts --mount`: its own hostname (which its /etc/hosts resolves to its address, as a
cluster's DNS would; gloo picks its address that way) and a private tmpfs on /dev/shm, so shared
memory works within a node and never across. Anything run through `exec_argv` (`nsenter` into the holder) is on
that node. Two nodes are joined by a veth pair; more hang off a bridge in a switch namespace of
their own (a star). Nothing is added to the machine's own network namespace, and traffic only ever
goes to the addresses inside these namespaces.

Each link is shaped by `tc tbf` on both ends' egress (full duplex). tbf caps a link below its rate
unless its bucket holds several of veth's 64 KiB offload segments at that rate, so the burst is
the rate times BURST_S (at least 256 KiB); the queue holds QUEUE_S of traffic, enough for TCP's
window to fill the link without bufferbloat. `measure_links` reports what each link delivers.

Names carry this process's pid and a count (`zrc<pid>-0n0`, `zrc<pid>-0sw`): `sweep_stale()` removes the namespaces,
processes and mounts of clusters whose owner has died (a killed test run), and never anyone else's.
`stop()` tears everything down and is safe to call after any failure, any number of times.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerorun.errors import ZerorunError

PREFIX = "zrc"
SUBNET = "10.77.0"
IFACE = "eth0"  # every node's link, inside its namespace (GLOO_SOCKET_IFNAME)
BURST_S = 0.008  # tbf's bucket: 8 ms of traffic (1 MB at 1 Gbit/s)
QUEUE_S = 0.020  # tbf's queue: 20 ms of traffic
SHM_SIZE = "4g"
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+(n\d+|sw)$")
_built = itertools.count()


class ClusterUnavailable(ZerorunError):
    """This machine cannot host an emulated cluster (no root, no `ip netns`, no `tc`); the message says why."""


def parse_rate(text: str) -> float:
    """'1gbit', '10gbit', '500mbit' -> bits per second."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)\s*", text.lower())
    if not match:
        raise ZerorunError(f"--link {text!r}: expected a rate such as 1gbit, 10gbit or 500mbit.")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_shape(text: str) -> tuple[int, int]:
    """'2x1' -> (2 nodes, 1 rank per node)."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text.lower())
    if not match or int(match.group(1)) < 2 or int(match.group(2)) < 1:
        raise ZerorunError(f"--cluster {text!r}: expected NODESxRANKS with at least 2 nodes, e.g. 2x1 or 2x2.")
    return int(match.group(1)), int(match.group(2))


def unavailable_reason() -> str | None:
    """Why no cluster can be emulated here, or None when it can."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, tc, mounts)"
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install iproute2 util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    hostname: str
    address: str
    holder_pid: int


@dataclass(frozen=True)
class LinkThroughput:
    """What one direction of a link delivered to a socket benchmark."""

    source: str
    destination: str
    gbit_s: float


class EmulatedCluster:
    """N nodes on this machine; see the module docstring."""

    def __init__(self, count: int, rate_bps: float) -> None:
        self.owner = os.getpid()
        self.rate_bps = rate_bps
        name = f"{PREFIX}{self.owner}-{next(_built)}"
        self.namespaces = [f"{name}n{i}" for i in range(count)]
        self.switch = f"{name}sw" if count > 2 else None
        self.nodes: list[Node] = []
        self.directory = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        self._holders: list[subprocess.Popen[bytes]] = []

    @classmethod
    def start(cls, nodes: int, link: str | float) -> EmulatedCluster:
        """Build the cluster (after sweeping stale ones); raise ClusterUnavailable if this machine cannot."""
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        sweep_stale()
        cluster = cls(nodes, parse_rate(link) if isinstance(link, str) else float(link))
        try:
            cluster._build()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def __enter__(self) -> EmulatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def exec_argv(self, node: Node) -> list[str]:
        """The prefix that runs a command on `node`: its network, hostname and mounts (/dev/shm)."""
        return ["nsenter", "-t", str(node.holder_pid), "-n", "-u", "-m", "--"]

    def run_on(self, node: Node, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.exec_argv(node), *argv], capture_output=True, text=True, **kwargs)

    def tx_bytes(self, node: Node) -> int:
        """Bytes `node` has sent on its link so far (the interface's counter, headers included)."""
        out = _ip(["-n", node.namespace, "-j", "-s", "link", "show", IFACE])
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def measure_links(self, seconds: float = 1.5) -> list[LinkThroughput]:
        """Each node's uplink, one after another: node i sends to node i+1 for `seconds` (TCP, one stream)."""
        from zerorun.bench import linkprobe

        results = []
        for node in self.nodes:
            peer = self.nodes[(node.index + 1) % len(self.nodes)]
            gbit_s = linkprobe.measure(self.exec_argv(node), self.exec_argv(peer), peer.address, seconds)
            results.append(LinkThroughput(node.hostname, peer.hostname, gbit_s))
        return results

    def stop(self) -> None:
        """Kill every process on the nodes, remove the namespaces (links and mounts go with them)."""
        for holder in self._holders:
            if holder.poll() is None:
                holder.kill()
            holder.wait()
        self._holders = []
        for namespace in [*self.namespaces, *([self.switch] if self.switch else [])]:
            remove_namespace(namespace)
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- building ---------------------------------------------------------------------------------

    def _build(self) -> None:
        for namespace in [*self.namespaces, *([self.switch] if self.switch else [])]:
            _ip(["netns", "add", namespace])
            _ip(["-n", namespace, "link", "set", "lo", "up"])
        if self.switch is None:
            _ip(["-n", self.namespaces[0], "link", "add", IFACE, "type", "veth", "peer", "name", IFACE,
                 "netns", self.namespaces[1]])
        else:
            _ip(["-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _ip(["-n", self.switch, "link", "set", "br0", "up"])
            for i, namespace in enumerate(self.namespaces):
                port = f"p{i}"
                _ip(["-n", namespace, "link", "add", IFACE, "type", "veth", "peer", "name", port,
                     "netns", self.switch])
                _ip(["-n", self.switch, "link", "set", port, "master", "br0"])
                _ip(["-n", self.switch, "link", "set", port, "up"])
                shape(self.switch, port, self.rate_bps)  # the switch's side of node i's link
        hosts = self.directory / "hosts"  # every node's name resolves to its address, as a cluster's DNS does
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} node{i}\n"
                                                           for i in range(len(self.namespaces))))
        for i, namespace in enumerate(self.namespaces):
            _ip(["-n", namespace, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", IFACE])
            _ip(["-n", namespace, "link", "set", IFACE, "up"])
            shape(namespace, IFACE, self.rate_bps)
            self.nodes.append(self._start_holder(i, namespace))

    def _start_holder(self, index: int, namespace: str) -> Node:
        hostname = f"node{index}"
        script = (f"hostname {hostname} && mount -t tmpfs -o size={SHM_SIZE},mode=1777 {PREFIX}shm /dev/shm "
                  f"&& mount --bind {self.directory / 'hosts'} /etc/hosts && echo ready && exec sleep infinity")
        holder = subprocess.Popen(["ip", "netns", "exec", namespace, "unshare", "--uts", "--mount",
                                   "--propagation", "private", "sh", "-c", script],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self._holders.append(holder)
        line = holder.stdout.readline()  # ip netns exec, unshare and sh all exec: the pid stays the holder's
        if line.strip() != b"ready":
            holder.kill()
            raise ClusterUnavailable(f"cannot start node {index}: {holder.stderr.read().decode(errors='replace')}")
        return Node(index, namespace, hostname, f"{SUBNET}.{index + 1}", holder.pid)


def shape(namespace: str, device: str, rate_bps: float) -> None:
    """tbf on `device`'s egress: `rate_bps`, a burst and queue sized so the link delivers that rate."""
    rate_bytes = rate_bps / 8
    burst = max(int(rate_bytes * BURST_S), 256 * 1024)
    limit = max(int(rate_bytes * QUEUE_S), 2 * burst)
    _ip(["-n", namespace, "link", "set", device, "txqueuelen", "10000"])
    _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{int(rate_bps)}bit",
          "burst", str(burst), "limit", str(limit)])


def remove_namespace(namespace: str) -> None:
    """Kill every process in `namespace` (it outlives its name otherwise), then delete it; quiet if gone."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        time.sleep(0.05)
    subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)


def sweep_stale() -> list[str]:
    """Remove the namespaces (and files) of emulated clusters whose owning process is gone; return their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    stale = []
    for name in (line.split()[0] for line in listed if line.strip()):
        match = _NAME.match(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            remove_namespace(name)
            stale.append(name)
    for directory in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*-*"):
        owner = re.match(rf"^{PREFIX}(\d+)-", directory.name)
        if owner and not Path(f"/proc/{owner.group(1)}").exists():
            shutil.rmtree(directory, ignore_errors=True)
    return stale


def _zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _ip(args: list[str]) -> str:
    return _run(["ip", *args])


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


if __name__ == "__main__":  # python -m zerorun.bench.cluster 2 1gbit: build, measure, tear down
    with EmulatedCluster.start(int(sys.argv[1]), sys.argv[2]) as built:
        for link in built.measure_links():
            print(f"{link.source} -> {link.destination}: {link.gbit_s:.2f} Gbit/s")
