"""Which node of a job this launcher is, when every node runs its own: flags first, else the environment.

    role = node_role(RoleFlags(nnodes=2, node_rank=None, ...), os.environ)   # None: a hostfile/ssh/slurm launch
    role.node_rank, role.nnodes, role.master_addr, role.link_port

`zerorun launch recipe.yaml --nnodes N --node-rank R --master-addr HOST --master-port PORT` runs on
every node, nothing started over SSH (pods of a Kubernetes Job, machines started some other way).
Where the cluster starts the pods, it tells each its place in the environment, and the flags may be
left out:

| value | flag | environment, first found |
|---|---|---|
| nodes | `--nnodes` | `PET_NNODES` (Kubeflow's PyTorchJob and TrainJob; torchrun reads it too) |
| this node's rank | `--node-rank` | `PET_NODE_RANK`, `JOB_COMPLETION_INDEX` (an Indexed Job, a JobSet) |
| node 0's address | `--master-addr` | `MASTER_ADDR`, `PET_MASTER_ADDR` |
| the rendezvous port | `--master-port` | `MASTER_PORT`, `PET_MASTER_PORT` (default 29500) |
| workers per node | `--nproc-per-node` | `PET_NPROC_PER_NODE` (else the recipe's `nproc_per_node`, else the GPUs) |

The mode is on when `--nnodes` or `PET_NNODES` is given: a stray MASTER_ADDR in a shell, or the
JOB_COMPLETION_INDEX of a one-pod Job, never turns a local launch into a wait for other nodes.
torchrun's rendezvous store takes the port on node 0; node 0's launcher takes the next one
(`link_port`) for the other nodes' launchers. Every value is checked here, pure, and a bad or
missing one is refused naming the flag or the variable it came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zerorun.errors import LaunchError

DEFAULT_PORT = 29500  # torchrun's default rendezvous port
NNODES_ENV = ("PET_NNODES",)
NODE_RANK_ENV = ("PET_NODE_RANK", "JOB_COMPLETION_INDEX")
MASTER_ADDR_ENV = ("MASTER_ADDR", "PET_MASTER_ADDR")
MASTER_PORT_ENV = ("MASTER_PORT", "PET_MASTER_PORT")
NPROC_ENV = ("PET_NPROC_PER_NODE",)


@dataclass(frozen=True)
class RoleFlags:
    """The command line's part (None: not given)."""

    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc_per_node: int | None = None


@dataclass(frozen=True)
class NodeRole:
    """This launcher's place in a job whose every node runs a launcher."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int  # torchrun's rendezvous (node 0)
    nproc_per_node: int | None  # None: the recipe's, else this node's GPUs, else 2
    origins: Mapping[str, str]  # value name -> where it came from (`--nnodes 2`, `PET_NNODES=2`)

    @property
    def link_port(self) -> int:
        """Where node 0's launcher listens for the others (the port after the rendezvous')."""
        return self.master_port + 1

    @property
    def is_first(self) -> bool:
        return self.node_rank == 0


def node_role(flags: RoleFlags, env: Mapping[str, str]) -> NodeRole | None:
    """This node's role, or None when neither `--nnodes` nor PET_NNODES asks for one."""
    origins: dict[str, str] = {}
    nnodes = _count("nnodes", "--nnodes", flags.nnodes, NNODES_ENV, env, origins, minimum=1)
    if nnodes is None:
        if flags.node_rank is not None:
            raise LaunchError(f"--node-rank {flags.node_rank} needs the number of nodes: add --nnodes N "
                              "(or set PET_NNODES).")
        return None
    rank = _count("node_rank", "--node-rank", flags.node_rank, NODE_RANK_ENV, env, origins, minimum=0)
    if rank is None:
        raise LaunchError(f"{origins['nnodes']}: which node is this one? Give --node-rank R (0 for the node whose "
                          "launcher the others join), or set PET_NODE_RANK; an Indexed Job sets JOB_COMPLETION_INDEX.")
    if rank >= nnodes:
        raise LaunchError(f"{origins['node_rank']} is not below {origins['nnodes']}: node ranks run 0..{nnodes - 1}.")
    port = _count("master_port", "--master-port", flags.master_port, MASTER_PORT_ENV, env, origins, minimum=1)
    port = DEFAULT_PORT if port is None else port
    if port > 65534:
        raise LaunchError(f"{origins['master_port']}: expected a port from 1 to 65534 (node 0's launcher listens "
                          "on the next one).")
    addr = _text("master_addr", "--master-addr", flags.master_addr, MASTER_ADDR_ENV, env, origins)
    if addr is None and nnodes > 1:
        raise LaunchError(f"{origins['nnodes']}: where is node 0? Give --master-addr HOST (node 0's address, "
                          "which every node can reach), or set MASTER_ADDR.")
    nproc = _nproc(flags.nproc_per_node, env, origins)
    return NodeRole(nnodes, rank, addr or "127.0.0.1", port, nproc, origins)


def _found(names: tuple[str, ...], env: Mapping[str, str]) -> tuple[str, str] | None:
    """The first of `names` set (non-empty) in `env`, with its value."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _count(key: str, flag: str, given: int | None, names: tuple[str, ...], env: Mapping[str, str],
           origins: dict[str, str], minimum: int) -> int | None:
    """A whole number from the flag, else the environment; its origin recorded under `key`."""
    if given is not None:
        origins[key] = f"{flag} {given}"
        value, origin = given, f"{flag} {given}"
    else:
        found = _found(names, env)
        if found is None:
            return None
        name, text = found
        origin = origins[key] = f"{name}={text}"
        if not text.isdigit():
            elastic = " (an elastic range: zerorun runs a fixed number of nodes)" if ":" in text else ""
            raise LaunchError(f"{origin}: expected a whole number{elastic}.")
        value = int(text)
    if value < minimum:
        raise LaunchError(f"{origin}: expected at least {minimum}.")
    return value


def _text(key: str, flag: str, given: str | None, names: tuple[str, ...], env: Mapping[str, str],
          origins: dict[str, str]) -> str | None:
    if given is not None:
        if not given.strip() or given.strip().startswith("-"):
            raise LaunchError(f"{flag} {given!r}: expected a host name or an address.")
        origins[key] = f"{flag} {given}"
        return given.strip()
    found = _found(names, env)
    if found is None:
        return None
    origins[key] = f"{found[0]}={found[1]}"
    if found[1].startswith("-"):
        raise LaunchError(f"{origins[key]}: expected a host name or an address.")
    return found[1]


def _nproc(given: int | None, env: Mapping[str, str], origins: dict[str, str]) -> int | None:
    """Workers per node: the flag, else PET_NPROC_PER_NODE (`auto` and `gpu`: as if unset), else None."""
    if given is not None:
        return given
    found = _found(NPROC_ENV, env)
    if found is None or found[1] in ("auto", "gpu"):
        return None
    origins["nproc_per_node"] = f"{found[0]}={found[1]}"
    if not found[1].isdigit() or int(found[1]) < 1:
        raise LaunchError(f"{origins['nproc_per_node']}: expected a whole number of workers per node (or auto).")
    return int(found[1])
