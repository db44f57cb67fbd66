"""What identifies a job's processes and files on a machine: the names every layer shares.

The launcher sets these, the runtime names its shared-memory segments and offload files by them,
and teardown finds a job's processes by them. They live here, below `launch` and `runtime`, so that
neither imports the other for a name.
"""

JOB_ID_ENV = "ZERORUN_JOB_ID"  # unique per launch: how teardown (and tests) find every process of a job
NODE_HOST_ENV = "ZERORUN_NODE_HOST"  # the host name a worker prints in its `[host:rank] ` prefix
SHM_DIR = "/dev/shm"


def shm_prefix(job_id: str | None) -> str:
    """How a job's shared-memory segments are named (`<SHM_DIR>/<prefix><pid>-<random>`): the node
    supervisor removes what a rank killed during their setup left behind."""
    return f"zerorun-{job_id}-" if job_id else "zerorun-"
