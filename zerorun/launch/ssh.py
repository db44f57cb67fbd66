"""SSH: the command line that reaches a host, and the transport that runs a node there.

`ssh_argv` builds `ssh [options] -- host command` from the recipe's `ssh:` section. The recipe's
`options` come first because ssh keeps the *first* value it sees for each option, so they win
over zerorun's defaults; `~/.ssh/config` is read by ssh itself and fills in whatever the command
line leaves unset (port, user, key, jump hosts...). zerorun's defaults: `BatchMode=yes` (fail
rather than prompt for a password), a connect timeout, and keepalives so that a host that stops
answering ends the client within about 10 s.

`SSHTransport` runs the node supervisor (`zerorun.launch.node`) on the host through ssh and
drives it exactly as a local node's (see `zerorun.launch.transport`): the job on stdin, heartbeats
both ways, `stop`/`kill` orders. If the connection is lost, the node sees EOF (or misses
heartbeats) and ends the job by itself; the launcher sees the ssh client exit (255 when the
connection closed) or the node fall silent, and says which.
"""

from __future__ import annotations

import os
import shlex
import signal
from collections.abc import Sequence

from zerorun.config import SSHConfig
from zerorun.errors import LaunchError
from zerorun.launch.hostfile import HOST_GRAMMAR, valid_host
from zerorun.launch.node import HEARTBEAT_TIMEOUT_S, MODULE
from zerorun.launch.plan import NodeCommand
from zerorun.launch.transport import SupervisedTransport, bootstrap_env

DEFAULT_OPTIONS = ("BatchMode=yes", "ConnectTimeout=10", "ServerAliveInterval=3", "ServerAliveCountMax=3")
SSH_FAILED = 255  # ssh's own status when the connection failed or closed


def ssh_argv(ssh: SSHConfig, host: str, command: str) -> list[str]:
    """`ssh ... -- host command`, with the recipe's settings before zerorun's defaults.

    `--` comes before the host: a host name starting with `-` is then a host, never an option (host
    names are also checked against the hostfile's grammar, `hostfile.valid_host`)."""
    if not valid_host(host):
        raise LaunchError(f"host {host!r} is not {HOST_GRAMMAR}; not passing it to ssh.")
    argv = ["ssh", "-T", "-x"]
    if ssh.port is not None:
        argv += ["-p", str(ssh.port)]
    if ssh.user:
        argv += ["-l", ssh.user]
    if ssh.identity_file:
        argv += ["-i", os.path.expanduser(ssh.identity_file), "-o", "IdentitiesOnly=yes"]
    for option in (*ssh.options, *DEFAULT_OPTIONS):
        argv += ["-o", option]
    return [*argv, "--", host, command]


def remote_command(python: str, env: dict[str, str], module_args: Sequence[str]) -> str:
    """The shell command line run on the host: `exec env K=V ... PYTHON -m MODULE ARGS`."""
    assigns = [f"{key}={value}" for key, value in env.items()]
    return shlex.join(["exec", "env", *assigns, python, "-m", *module_args])


class SSHTransport(SupervisedTransport):
    """The node's torchrun on another host, under its node supervisor, through ssh."""

    what = "torchrun over ssh"

    def __init__(self, host: str, job_id: str, ssh: SSHConfig, kill_grace_s: float) -> None:
        super().__init__(host, job_id, kill_grace_s)
        self.ssh = ssh

    def command(self, node: NodeCommand) -> tuple[list[str], dict[str, str] | None]:
        command = remote_command(node.argv[0], bootstrap_env(node),
                                 [MODULE, "--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT_S:g}"])
        return ssh_argv(self.ssh, node.host, command), None

    def lost_link(self, silent_s: float) -> str | None:
        code = self.poll()
        if code == SSH_FAILED:
            return f"ssh to {self.host} closed (exit code {SSH_FAILED}): the connection failed or was lost"
        if code is not None and code < 0:
            return f"lost contact with {self.host}: its ssh client was killed ({signal.Signals(-code).name})"
        return super().lost_link(silent_s)
