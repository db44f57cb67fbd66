"""An emulated cluster with an sshd on every node and a hostfile for them, for the launch tests.

    with ClusterWithSSH.start(directory, nodes=2, link="1gbit") as cluster:
        cluster.hostfile(slots=1)   # "10.77.0.1 slots=1\n10.77.0.2 slots=1\n", written to a file
        cluster.recipe_section()    # the recipe's `ssh:` section
        cluster.launcher_prefix()   # run `zerorun launch` on node 0, as a user on the first node would

The nodes come from `zerorun.bench.cluster` (own network namespace, hostname and /dev/shm, shaped
links); each runs its own sshd on port 22 of its own address, sharing one host key and one client key.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.launch.sshd import make_keys, start_sshd
from zerorun.bench.cluster import EmulatedCluster, Node

SSH_PORT = 22  # every node has a port space of its own


class ClusterWithSSH:
    def __init__(self, directory: Path, cluster: EmulatedCluster) -> None:
        self.directory = directory
        self.cluster = cluster
        self.nodes = cluster.nodes
        self.key = directory / "client_key"
        self._sshds: list[subprocess.Popen[bytes]] = []

    @classmethod
    def start(cls, directory: Path, nodes: int = 2, link: str = "1gbit") -> ClusterWithSSH:
        cluster = EmulatedCluster.start(nodes, link)
        built = cls(directory, cluster)
        try:
            make_keys(directory)
            built._sshds = [start_sshd(directory, f"sshd-{node.hostname}", SSH_PORT, [node.address],
                                       cluster.exec_argv(node)) for node in cluster.nodes]
            built._wait_until_logins_work()
        except BaseException:
            built.stop()
            raise
        return built

    def __enter__(self) -> ClusterWithSSH:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for sshd in self._sshds:
            if sshd.poll() is None:
                sshd.kill()
            sshd.wait()
        self.cluster.stop()  # and anything an ssh session left on a node

    def ssh_options(self) -> list[str]:
        return ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]

    def recipe_section(self) -> dict[str, object]:
        return {"port": SSH_PORT, "identity_file": str(self.key), "options": self.ssh_options()}

    def hostfile(self, path: Path, slots: int = 1) -> Path:
        path.write_text("".join(f"{node.address} slots={slots}\n" for node in self.nodes))
        return path

    def launcher_prefix(self) -> list[str]:
        return self.cluster.exec_argv(self.nodes[0])

    def ssh(self, source: Node, target: Node, command: str) -> subprocess.CompletedProcess[str]:
        """Run `command` on `target` over ssh from `source`."""
        argv = ["ssh", "-p", str(SSH_PORT), "-i", str(self.key), "-o", "BatchMode=yes",
                *(arg for option in self.ssh_options() for arg in ("-o", option)), target.address, command]
        return self.cluster.run_on(source, argv, timeout=30)

    def _wait_until_logins_work(self) -> None:
        deadline = time.monotonic() + 15
        while True:
            results = [self.ssh(self.nodes[0], node, "true") for node in self.nodes]
            if all(r.returncode == 0 for r in results):
                return
            if time.monotonic() > deadline or any(s.poll() is not None for s in self._sshds):
                logs = " ".join(p.read_text(errors="replace") for p in self.directory.glob("sshd-*.log"))
                raise RuntimeError(f"the nodes' sshd do not accept key logins: {results[-1].stderr.strip()} {logs}")
            time.sleep(0.2)
