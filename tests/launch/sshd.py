"""A private sshd on loopback for the SSH launch tests: two addresses, two "hosts".

    with PrivateSSHD.start(directory) as sshd:
        sshd.hosts                 # ("127.0.0.1", "127.0.0.2")
        sshd.recipe_section()      # the recipe's `ssh:` section: port, key, no host-key checks

It has its own host key, a generated client key in its `authorized_keys`, and everything (config,
pid file, keys) in `directory`; `stop()` ends it. The fixture skips when no `sshd` is installed
or it cannot accept a login here (CI installs openssh-server, so there the tests run).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

HOSTS = ("127.0.0.1", "127.0.0.2")
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


def find_sshd() -> str | None:
    return shutil.which("sshd") or next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)


class PrivateSSHD:
    def __init__(self, directory: Path, proc: subprocess.Popen[bytes], port: int, key: Path) -> None:
        self.directory = directory
        self.proc = proc
        self.port = port
        self.key = key
        self.hosts = HOSTS

    @classmethod
    def start(cls, directory: Path) -> PrivateSSHD:
        """Start sshd on a free port of both loopback addresses; raise RuntimeError if it cannot."""
        make_keys(directory)
        port = _free_port()
        proc = start_sshd(directory, "sshd", port, HOSTS)
        server = cls(directory, proc, port, directory / "client_key")
        server._wait_until_login_works()
        return server

    def ssh_options(self) -> list[str]:
        return ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR"]

    def recipe_section(self) -> dict[str, object]:
        return {"port": self.port, "identity_file": str(self.key), "options": self.ssh_options()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _wait_until_login_works(self) -> None:
        deadline = time.monotonic() + 10
        argv_tail = ["-p", str(self.port), "-i", str(self.key), "-o", "BatchMode=yes",
                     *(arg for option in self.ssh_options() for arg in ("-o", option))]
        while True:
            results = [subprocess.run(["ssh", *argv_tail, host, "true"], capture_output=True, text=True)
                       for host in HOSTS]
            if all(r.returncode == 0 for r in results):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = (self.directory / "sshd.log").read_text(errors="replace")
                raise RuntimeError(f"the private sshd does not accept key logins: {results[-1].stderr.strip()} {log}")
            time.sleep(0.2)


def make_keys(directory: Path) -> None:
    """A host key, a client key and an `authorized_keys` holding the client's, all in `directory`."""
    keygen = shutil.which("ssh-keygen")
    if find_sshd() is None or keygen is None or shutil.which("ssh") is None:
        raise RuntimeError("sshd, ssh or ssh-keygen is not installed (apt-get install openssh-server)")
    for name in ("host_key", "client_key"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)], check=True)
    (directory / "authorized_keys").write_text((directory / "client_key.pub").read_text())


def start_sshd(directory: Path, name: str, port: int, hosts: Sequence[str],
               prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    """sshd on `hosts`:`port` with the keys of `make_keys`, run through `prefix` (e.g. on an emulated node);
    its config, pid file and log are `directory`/`name`.*."""
    config = directory / f"{name}.config"
    config.write_text("\n".join([
        f"Port {port}", *(f"ListenAddress {host}" for host in hosts),
        f"HostKey {directory / 'host_key'}", f"PidFile {directory / f'{name}.pid'}",
        f"AuthorizedKeysFile {directory / 'authorized_keys'}",
        "StrictModes no", "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes", "PermitRootLogin yes", "LogLevel ERROR", "",
    ]))
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    return subprocess.Popen([*prefix, find_sshd(), "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(directory / f"{name}.log", "wb"))


def _free_port() -> int:
    """A port free on both loopback addresses."""
    for _ in range(20):
        with socket.socket() as sock:
            sock.bind((HOSTS[0], 0))
            port = sock.getsockname()[1]
        try:
            with socket.socket() as other:
                other.bind((HOSTS[1], port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on both loopback addresses")
