"""Hostfiles and node selection, compatible with DeepSpeed's launcher so existing files work unchanged.

A hostfile lists one machine per line as `HOSTNAME slots=N` (N = GPUs, or CPU workers, on it);
`#` starts a comment, blank lines are skipped, and the order of the lines is the node order, hence
the rank order. Anything after the `slots=N` token is ignored, as DeepSpeed (and OpenMPI's
`max_slots=`) allow.

`select_nodes` applies DeepSpeed's flags to the parsed hosts, always in this order:

1. `--include` or `--exclude` (never both): `NAME[:SLOT[,SLOT...]]` joined by `@`, e.g.
   `worker-0@worker-1:0,2`. A bare name means all of that host's slots.
2. `--num-nodes N`: the first N remaining hosts.
3. `--num-gpus N`: the first N remaining slots of each host.

The result follows the hostfile's order, never the filter's; slots are ascending. Naming a host
or a slot twice in a filter is harmless (DeepSpeed accepts it too): repeats are merged.
Unlike DeepSpeed, `--num-gpus` above a host's slot count is an error rather than a silent cap.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from zerorun.errors import HostfileError

_SLOTS = "slots="
_EXPECTED_LINE = "expected 'HOSTNAME slots=N', e.g. 'worker-0 slots=4' (DeepSpeed hostfile format)"
_EXPECTED_FILTER = "expected NAME[:SLOT[,SLOT...]] joined by '@', e.g. 'worker-0@worker-1:0,2'"
_NUMBER = re.compile(r"[0-9]+")  # str.isdigit() would also accept '²'
# A host name: letters, digits, '-', '_' and '.', starting and ending with a letter or digit (RFC 1123,
# with '_' as ssh and DNS in practice allow it); or an IP address. Nothing ssh could read as an option.
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")
HOST_GRAMMAR = "a host name (letters, digits, '-', '_', '.'; not starting with '-') or an IP address"


def valid_host(host: str) -> bool:
    """Whether `host` is a host name or an IP address (never an option, a user@, a port or a path)."""
    if _HOST_NAME.fullmatch(host):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Node:
    """One machine of the job: its hostname and the slot (GPU) indices it runs workers on."""

    host: str
    slots: tuple[int, ...]  # ascending; become CUDA_VISIBLE_DEVICES on GPU nodes

    @property
    def nproc(self) -> int:
        """How many worker processes this node starts: one per slot."""
        return len(self.slots)


def parse_hostfile(path: str | os.PathLike[str]) -> dict[str, int]:
    """Host -> slot count, in file order, read from the hostfile at `path`."""
    try:
        # utf-8-sig: a byte-order mark from a Windows editor must not become part of the first host
        with open(path, encoding="utf-8-sig") as file:
            text = file.read()
    except FileNotFoundError:
        raise HostfileError(f"hostfile not found: {os.fspath(path)}") from None
    except UnicodeDecodeError as err:
        raise HostfileError(f"{os.fspath(path)}: not a text file ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise HostfileError(f"cannot read hostfile {os.fspath(path)}: {err.strerror}") from None
    return parse_hostfile_text(text, os.fspath(path))


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Host -> slot count, in file order, from hostfile text; `source` names the file in errors."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        where = f"{source}:{lineno}"
        host, slots = _parse_entry(entry, where)
        if host in hosts:
            raise HostfileError(
                f"{where}: host {host!r} is listed twice (first on line {first_line[host]}); "
                "list each host once with all its slots"
            )
        hosts[host] = slots
        first_line[host] = lineno
    if not hosts:
        raise HostfileError(f"{source}: no hosts found; {_EXPECTED_LINE}")
    return hosts


def _parse_entry(entry: str, where: str) -> tuple[str, int]:
    """Host and slot count of one hostfile line, its comment already removed."""
    host, *rest = entry.split()
    if host.startswith(_SLOTS):
        raise _line_error(where, entry, "the host name is missing")
    if not valid_host(host):
        meant = " ".join([host.rstrip(":"), *rest])
        hint = f"; did you mean {meant!r}?" if host.endswith(":") and valid_host(host.rstrip(":")) else ""
        raise HostfileError(f"{str(_line_error(where, entry, f'{host!r} is not {HOST_GRAMMAR}'))}{hint}")
    if not rest:
        raise _line_error(where, entry, f"host {host!r} has no slot count")
    if not rest[0].startswith(_SLOTS):
        raise _line_error(where, entry, f"expected 'slots=N' after the host name, got {rest[0]!r}")
    count = rest[0][len(_SLOTS):]
    if not _NUMBER.fullmatch(count):
        raise _line_error(where, entry, f"the slot count must be a whole number, got {rest[0]!r}")
    if int(count) == 0:
        raise HostfileError(
            f"{where}: host {host!r} has slots=0; give it at least 1 slot, or delete the line to leave it out"
        )
    return host, int(count)


def _line_error(where: str, entry: str, problem: str) -> HostfileError:
    """A malformed-line error: where, what is wrong, the line itself and the expected format."""
    return HostfileError(f"{where}: {problem} in {entry!r}; {_EXPECTED_LINE}")


def select_nodes(
    hosts: Mapping[str, int],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> list[Node]:
    """The nodes to run on: `hosts` narrowed by include or exclude, then num_nodes, then num_gpus.

    An empty `include`/`exclude` string counts as not given (DeepSpeed's flag default is "").
    """
    if include and exclude:
        raise HostfileError(
            f"--include={include} and --exclude={exclude} cannot be combined; "
            "use one (--include lists what to keep, --exclude what to drop)"
        )
    assert all(count >= 1 for count in hosts.values()), f"select_nodes: slot counts must be >= 1: {hosts}"
    pool = {host: tuple(range(count)) for host, count in hosts.items()}
    after = ""  # names the filter in later errors, which are puzzling without it
    if include:
        pool = _filter_pool(pool, _named_slots("--include", include, hosts), keep_named=True)
        after = f" after --include={include}"
    elif exclude:
        pool = _filter_pool(pool, _named_slots("--exclude", exclude, hosts), keep_named=False)
        after = f" after --exclude={exclude}"
    if not pool:
        problem = f"no slots left to run on{after}" if after else "no hosts to run on: the host list is empty"
        raise HostfileError(problem)
    if num_nodes is not None:
        pool = _first_nodes(pool, num_nodes, after)
    if num_gpus is not None:
        pool = _first_slots(pool, num_gpus, after)
    return [Node(host, slots) for host, slots in pool.items()]


def load(
    path: str | os.PathLike[str],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> list[Node]:
    """The nodes to run on from the hostfile at `path`: `parse_hostfile` then `select_nodes`."""
    return select_nodes(parse_hostfile(path), include, exclude, num_nodes, num_gpus)


def local_node(nproc: int) -> Node:
    """The single-node default when there is no hostfile: `Node('localhost', (0, ..., nproc - 1))`."""
    if nproc < 1:
        raise HostfileError(f"a local run needs at least 1 process, got {nproc}")
    return Node("localhost", tuple(range(nproc)))


def _named_slots(flag: str, spec: str, hosts: Mapping[str, int]) -> dict[str, set[int]]:
    """The slots each host named in an --include/--exclude `spec` refers to, merged over repeats."""
    named: dict[str, set[int]] = {}
    for token in spec.split("@"):
        host, slots = _parse_node_spec(flag, spec, token, hosts)
        named.setdefault(host, set()).update(slots)
    return named


def _parse_node_spec(flag: str, spec: str, token: str, hosts: Mapping[str, int]) -> tuple[str, set[int]]:
    """Host and slots of one `NAME[:SLOT[,SLOT...]]` token of a filter."""
    if not token:
        raise HostfileError(f"{flag}={spec}: empty entry between '@' separators; {_EXPECTED_FILTER}")
    # A whole token that is a host is a bare name: this keeps IPv6 hosts like '::1' usable.
    if token in hosts:
        return token, set(range(hosts[token]))
    host, colon, slot_list = token.rpartition(":")
    if not colon:
        host = token
    if host not in hosts:
        raise HostfileError(f"{flag}={spec}: unknown host {host!r}; hosts in the hostfile: {', '.join(hosts)}")
    return host, {_parse_slot(flag, spec, host, slot, hosts[host]) for slot in slot_list.split(",")}


def _parse_slot(flag: str, spec: str, host: str, slot: str, count: int) -> int:
    """One slot index of a filter, checked against the host's slot count."""
    valid = f"valid slots on {host!r}: {_slot_range(count)}"
    if not _NUMBER.fullmatch(slot):
        raise HostfileError(f"{flag}={spec}: slot {slot!r} on {host!r} is not a slot index; {valid}")
    if int(slot) >= count:
        raise HostfileError(f"{flag}={spec}: slot {int(slot)} is out of range for {host!r}; {valid}")
    return int(slot)


def _slot_range(count: int) -> str:
    """The valid slot indices of a host with `count` slots, as users write them ('0-3')."""
    return "0" if count == 1 else f"0-{count - 1}"


def _filter_pool(
    pool: dict[str, tuple[int, ...]], named: dict[str, set[int]], keep_named: bool
) -> dict[str, tuple[int, ...]]:
    """`pool` keeping only the named slots (include) or all but them (exclude); emptied hosts drop out."""
    result: dict[str, tuple[int, ...]] = {}
    for host, slots in pool.items():
        kept = tuple(slot for slot in slots if (slot in named.get(host, ())) == keep_named)
        if kept:
            result[host] = kept
    return result


def _first_nodes(pool: dict[str, tuple[int, ...]], num_nodes: int, after: str) -> dict[str, tuple[int, ...]]:
    """The first `num_nodes` hosts of `pool`, for --num-nodes."""
    _check_count("--num-nodes", num_nodes)
    if num_nodes > len(pool):
        raise HostfileError(
            f"--num-nodes={num_nodes}: only {len(pool)} host(s) available{after}: {', '.join(pool)}"
        )
    return dict(list(pool.items())[:num_nodes])


def _first_slots(pool: dict[str, tuple[int, ...]], num_gpus: int, after: str) -> dict[str, tuple[int, ...]]:
    """The first `num_gpus` slots of every host in `pool`, for --num-gpus."""
    _check_count("--num-gpus", num_gpus)
    host, slots = min(pool.items(), key=lambda item: len(item[1]))  # the first of the smallest hosts
    if num_gpus > len(slots):
        listed = ",".join(str(slot) for slot in slots)
        raise HostfileError(
            f"--num-gpus={num_gpus}: host {host!r} has only {len(slots)} slot(s){after} ({listed}); "
            f"use --num-gpus={len(slots)} or fewer"
        )
    return {host: slots[:num_gpus] for host, slots in pool.items()}


def _check_count(flag: str, value: int) -> None:
    # bool is an int subclass; --num-nodes=True is a caller bug worth a clear message
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HostfileError(f"{flag}={value!r}: must be a whole number of at least 1")
