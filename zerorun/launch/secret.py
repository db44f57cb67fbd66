"""The job's secret when every node runs its own launcher: what makes a connection one of the job's.

Over SSH the launcher makes a random secret per job and hands it to every node through ssh. When
each node starts its own launcher (a Kubernetes Job's pods, machines started by hand), nobody is
there to hand it out: every node gets the same secret from its environment, `ZERORUN_JOB_SECRET`
(a Kubernetes Secret, never a manifest or a command line). It proves each launcher to node 0's and
node 0's to each of them (`launch.link`), and the telemetry token comes from it (`telemetry_token`),
so the workers never hold the secret that admits a launcher. The launcher takes the variable out of
its own environment once read: nothing it starts inherits it.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from zerorun.errors import LaunchError
from zerorun.telemetry.records import prove

SECRET_ENV = "ZERORUN_JOB_SECRET"
MIN_LENGTH = 32  # characters: 128 bits as hex
MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"


def take_secret(env: MutableMapping[str, str]) -> str:
    """The job's secret, removed from `env` (the launcher's own environment: its children do not inherit it)."""
    secret = env.pop(SECRET_ENV, "").strip()
    if not secret:
        raise LaunchError(f"{SECRET_ENV} is not set: every node's launcher proves it to node 0's, and node 0's to "
                          f"them. Set the same random value on every node (e.g. `export {SECRET_ENV}=$({MAKE_ONE})`); "
                          "`zerorun submit --to kubernetes` puts it in a Kubernetes Secret.")
    if len(secret) < MIN_LENGTH:
        raise LaunchError(f"{SECRET_ENV} has {len(secret)} characters: too short to keep other connections out; "
                          f"use at least {MIN_LENGTH} random ones (e.g. `{MAKE_ONE}`).")
    return secret


def telemetry_token(secret: str) -> str:
    """The collector's token for a job of this secret: the same on every node, and not the secret itself."""
    return prove(secret, "zerorun telemetry token")
