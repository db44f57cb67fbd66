"""Launching a job: plan (pure), transports (local, ssh + remote supervisor), supervisor (lifecycle), worker bootstrap.

`zerorun.launch.launcher` is the entry point the CLI calls. This package's `__init__` stays tiny
because every worker imports it before forking its output relay.
"""

JOB_ID_ENV = "ZERORUN_JOB_ID"  # unique per launch: how teardown (and tests) find every process of a job
NODE_HOST_ENV = "ZERORUN_NODE_HOST"  # the host name a worker prints in its `[host:rank] ` prefix
SHM_DIR = "/dev/shm"


def shm_prefix(job_id: str | None) -> str:
    """How a job's shared-memory segments are named (`<SHM_DIR>/<prefix><pid>-<random>`): the node
    supervisor removes what a rank killed during their setup left behind."""
    return f"zerorun-{job_id}-" if job_id else "zerorun-"
