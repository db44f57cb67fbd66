"""SSH: the command line that reaches a host, and the transport that runs a node there.

`ssh_argv` builds `ssh [options] host -- command` from the recipe's `ssh:` section. The recipe's
`options` come first because ssh keeps the *first* value it sees for each option, so they win
over zerorun's defaults; `~/.ssh/config` is read by ssh itself and fills in whatever the command
line leaves unset (port, user, key, jump hosts...). zerorun's defaults: `BatchMode=yes` (fail
rather than prompt for a password), a connect timeout, and keepalives so that a host that stops
answering ends the client within about 10 s.

`SSHTransport` starts `python -m zerorun.launch.remote` on the host (see that module for why a
remote supervisor and not torchrun directly), sends it the node's command, environment and
working directory as one JSON line on stdin, then a heartbeat line every second. To stop the
node it closes stdin: the remote supervisor tears the node's process groups down (SIGTERM, then
SIGKILL after the grace period) and exits with torchrun's status. If the connection is lost
instead, the remote side sees EOF (or misses heartbeats) and does the same on its own.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
from collections.abc import Sequence
from typing import IO

from zerorun.config import SSHConfig
from zerorun.errors import LaunchError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV
from zerorun.launch.plan import NodeCommand
from zerorun.launch.remote import HEARTBEAT_TIMEOUT_S
from zerorun.launch.transport import _KILL_WAIT_S, Transport, _die_with_parent

HEARTBEAT_S = 1.0
DEFAULT_OPTIONS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=3", "ServerAliveCountMax=3")
_EXIT_WAIT_S = 5.0  # after the remote grace period: for its SIGKILL round and the exit to travel back


def ssh_argv(ssh: SSHConfig, host: str, command: str) -> list[str]:
    """`ssh ... host -- command`, with the recipe's settings before zerorun's defaults."""
    argv = ["ssh", "-T", "-x"]
    if ssh.port is not None:
        argv += ["-p", str(ssh.port)]
    if ssh.user:
        argv += ["-l", ssh.user]
    if ssh.identity_file:
        argv += ["-i", os.path.expanduser(ssh.identity_file), "-o", "IdentitiesOnly=yes"]
    for option in (*ssh.options, *DEFAULT_OPTIONS):
        argv += ["-o", option]
    return [*argv, host, "--", command]


def remote_command(python: str, env: dict[str, str], module_args: Sequence[str]) -> str:
    """The shell command line run on the host: `exec env K=V ... PYTHON -m MODULE ARGS`."""
    assigns = [f"{key}={value}" for key, value in env.items()]
    return shlex.join(["exec", "env", *assigns, python, "-m", *module_args])


def bootstrap_env(node: NodeCommand) -> dict[str, str]:
    """The few variables the remote supervisor needs before it reads the rest from stdin: the job
    id and host (teardown finds the node's processes by them) and what makes zerorun importable."""
    keys = (JOB_ID_ENV, NODE_HOST_ENV, "PYTHONPATH", "PATH", "VIRTUAL_ENV")
    return {key: node.env[key] for key in keys if key in node.env}


class SSHTransport(Transport):
    """The node's torchrun on another host, under `python -m zerorun.launch.remote`, through ssh."""

    what = "torchrun over ssh"

    def __init__(self, host: str, job_id: str, ssh: SSHConfig, kill_grace_s: float) -> None:
        super().__init__(host, job_id)
        self.ssh = ssh
        self.kill_grace_s = kill_grace_s  # the remote supervisor's, between its SIGTERM and SIGKILL
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdin_lock = threading.Lock()
        self._stopped = threading.Event()

    def argv(self, node: NodeCommand) -> list[str]:
        command = remote_command(node.argv[0], bootstrap_env(node), ["zerorun.launch.remote", "--heartbeat-timeout",
                                                                   f"{HEARTBEAT_TIMEOUT_S:g}"])
        return ssh_argv(self.ssh, node.host, command)

    def start(self, node: NodeCommand) -> tuple[IO[bytes], IO[bytes]]:
        try:
            self._proc = subprocess.Popen(
                self.argv(node), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise LaunchError(f"host {self.host}: cannot start ssh: {exc.strerror or exc}; "
                              "install an OpenSSH client on the launching machine.") from None
        header = {"argv": list(node.argv), "env": dict(node.env), "cwd": node.cwd, "kill_grace_s": self.kill_grace_s}
        self._send(json.dumps(header).encode() + b"\n")
        threading.Thread(target=self._heartbeat, name=f"zerorun-heartbeat-{self.host}", daemon=True).start()
        assert self._proc.stdout is not None and self._proc.stderr is not None
        return self._proc.stdout, self._proc.stderr

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def stop(self, grace_s: float) -> int:
        """Close stdin (the remote supervisor stops the node) and wait; kill the client if it hangs."""
        self._stopped.set()
        if self._proc is None:
            return 0
        running = self._proc.poll() is None
        with self._stdin_lock:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=grace_s + _KILL_WAIT_S + _EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # the host stopped answering: the remote side ends by itself
            self._proc.kill()
            self._proc.wait()
        return int(running)

    def _heartbeat(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            if self.poll() is not None or not self._send(b"\n"):
                return

    def _send(self, data: bytes) -> bool:
        with self._stdin_lock:
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()
                return True
            except (OSError, ValueError):
                return False
