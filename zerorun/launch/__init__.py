"""Launching a job: plan (pure), transports (local, ssh + remote supervisor), supervisor (lifecycle), worker bootstrap.

`zerorun.launch.launcher` is the entry point the CLI calls. This package's `__init__` stays tiny
because every worker imports it before forking its output relay.
"""

from zerorun.jobs import JOB_ID_ENV, NODE_HOST_ENV, SHM_DIR, shm_prefix  # noqa: F401 - the launcher's names
