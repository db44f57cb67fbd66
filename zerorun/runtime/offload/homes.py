"""Homes: where this rank's flat optimizer state (fp32 master weights, the optimizer's own state) lives.

Every piece of state is addressed the same way whatever its home: per param group, an element
range of this rank's flat state (the units' pieces back to back, `units.py`), per *kind*: `master`,
then the kinds the group's optimizer keeps per element (Adam: `exp_avg`, `exp_avg_sq`; SGD with
momentum: `momentum_buffer`; none for a group whose optimizer runs on whole parameters, whose state
lives with their owner: optim/owner_step.py). The placement (`placement.py`) builds one home from the
recipe, once:

| home         | master + moments                                   | built for                              |
|--------------|----------------------------------------------------|----------------------------------------|
| `MemoryHome` | tensors on the device, or on the host              | no offload; `offload_optimizer: cpu`   |
| `NvmeHome`   | files under `<nvme_path>/<run>/rank-<r>/`, streamed | `offload_optimizer: nvme`              |

For fp32 stages 0-2 without offload the master *is* the parameters' own pieces: the memory home
is built around those views instead of a copy (`MemoryHome(master=...)`), so no byte is stored
twice. The optimizer step visits tiles of the state (`visit`); checkpoints and stage 3's
`gathered(modify=True)` read and write ranges (`read`, `write`).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.partition import intersect

MASTER = "master"
ADAM_KINDS = ("exp_avg", "exp_avg_sq")  # Adam's state kinds, named as torch's Adam names them
Visit = Callable[[int, dict[str, torch.Tensor]], None]  # fn(k, {kind: the k-th span's state of that kind})


def group_kinds(state_kinds: Sequence[Sequence[str]] | None, groups: int) -> list[tuple[str, ...]]:
    """Per group, every kind a home holds: the master first, then the optimizer's (Adam's when not given)."""
    given = state_kinds if state_kinds is not None else [ADAM_KINDS] * groups
    assert len(given) == groups, "one list of state kinds per param group"
    return [(MASTER, *kinds) for kinds in given]


@runtime_checkable
class Home(Protocol):
    """This rank's master weights and flat optimizer state, per param group and kind, wherever they live."""

    def kinds(self, group: int) -> tuple[str, ...]:
        """The kinds `group` holds: `master`, then its optimizer's."""

    def visit(self, group: int, spans: Sequence[tuple[int, int]], fn: Visit) -> None:
        """Call `fn(k, views)` with the k-th span's state of every kind, in order; changes persist."""

    def read(self, group: int, kind: str, out: torch.Tensor, start: int = 0) -> None:
        """Copy `kind` of `group` from element `start` into `out`."""

    def write(self, group: int, kind: str, values: torch.Tensor, start: int = 0) -> None:
        """Overwrite `kind` of `group` from element `start` with `values`."""

    def state(self, group: int, kind: str) -> torch.Tensor:
        """All of `kind` for `group` as one contiguous host tensor (the home's own when it already is one)."""

    def window(self, group: int, kind: str, start: int, numel: int, device: torch.device) -> torch.Tensor | None:
        """Elements [start, start + numel) of `kind` as the home's own memory, when they lie in one tensor on
        `device` (a step may then work on them in place); None where they do not (files, another device, two
        segments): read and write them instead."""

    @property
    def resident(self) -> torch.device | None:
        """Where the state lives in memory (a background save copies it from there); None: in files."""

    def place_of(self, group: int, offset: int) -> str:
        """Where `group`'s state at element `offset` lives: "device" (updated there, in place), "host" or "nvme"
        (streamed through the step's staging)."""

    def account(self, report: MemoryReport) -> None:
        """Add the bytes this home holds (master, optimizer, its buffers) to `report`."""

    def io_stats(self) -> dict[str, dict[str, float]]:
        """Cumulative I/O of the home itself (NVMe reads and writes; nothing for memory)."""

    def close(self) -> None: ...


class MemoryHome:
    """Master and state as fp32 tensors at `place` (the device, or the host for `offload_optimizer: cpu`), or split
    between the host and the device (`offload_optimizer_ratio` < 1: `MemoryHome.split`)."""

    def __init__(self, group_numels: Sequence[int], place: torch.device,
                 master: list[list[tuple[int, torch.Tensor]]] | None = None, role: str = "device",
                 segments: list[list[tuple[int, int, torch.device, str]]] | None = None,
                 state_kinds: Sequence[Sequence[str]] | None = None) -> None:
        """`master`: per group, (state offset, tensor) segments that already hold the master (the fp32
        parameters' own pieces); by default a zeroed tensor per group, filled by the store's `write`. `role`:
        "device" or "host" (`place_of`; on a CPU-only machine both are the CPU). `segments`: per group, (start, end,
        torch device, role) ranges of the state (default: all of it at `place`, in `role`). `state_kinds`: per group,
        the optimizer's kinds (default: Adam's), zeroed."""
        self.place = place
        self.master_is_params = master is not None
        ranges = segments or [[(0, n, place, role)] for n in group_numels]
        self._roles = [[(lo, where_role) for lo, _, _, where_role in group] for group in ranges]
        self._kinds = group_kinds(state_kinds, len(ranges))

        def zeros(group: list[tuple[int, int, torch.device, str]]) -> list[tuple[int, torch.Tensor]]:
            return [(lo, torch.zeros(hi - lo, dtype=torch.float32, device=where)) for lo, hi, where, _ in group]
        # per group, per kind: (state offset, tensor) segments
        self._state = [{kind: master[g] if master is not None and kind == MASTER else zeros(group) for kind in kinds}
                       for g, (group, kinds) in enumerate(zip(ranges, self._kinds))]

    def kinds(self, group: int) -> tuple[str, ...]:
        return self._kinds[group]

    def _view(self, group: int, kind: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of `kind`, which must lie inside one segment (the step's tiles do)."""
        segments = self._state[group][kind]
        offset, tensor = segments[bisect.bisect_right([start for start, _ in segments], lo) - 1]
        assert hi - offset <= tensor.numel(), f"{kind} span {lo}..{hi} crosses a segment boundary"
        return tensor[lo - offset:hi - offset]

    def window(self, group: int, kind: str, start: int, numel: int, device: torch.device) -> torch.Tensor | None:
        segments = self._state[group][kind]
        offset, tensor = segments[bisect.bisect_right([lo for lo, _ in segments], start) - 1]
        if start + numel - offset > tensor.numel() or tensor.device != device:
            return None
        return tensor[start - offset:start + numel - offset]

    @classmethod
    def split(cls, group_numels: Sequence[int], host_numels: Sequence[int], host: torch.device,
              device: torch.device, state_kinds: Sequence[Sequence[str]] | None = None) -> MemoryHome:
        """Each group's first `host_numels` elements of state on the host, the rest on the device (DeepSpeed's
        Twin-Flow: the device updates its share with its own kernel while the host updates the rest)."""
        ranges = [[r for r in ((0, h, host, "host"), (h, n, device, "device")) if r[1] > r[0]] or [(0, 0, host, "host")]
                  for n, h in zip(group_numels, host_numels)]
        return cls(group_numels, host, segments=ranges, state_kinds=state_kinds)

    @property
    def resident(self) -> torch.device:
        return self.place

    def place_of(self, group: int, offset: int) -> str:
        roles = self._roles[group]
        return roles[bisect.bisect_right([lo for lo, _ in roles], offset) - 1][1]

    def visit(self, group: int, spans: Sequence[tuple[int, int]], fn: Visit) -> None:
        for k, (lo, hi) in enumerate(spans):
            fn(k, {kind: self._view(group, kind, lo, hi) for kind in self._kinds[group]})

    def _copies(self, group: int, kind: str, start: int, numel: int) -> Iterator[tuple[torch.Tensor, int]]:
        """(segment view, offset inside the caller's tensor) for each segment overlapping [start, start+numel)."""
        for offset, tensor in self._state[group][kind]:
            both = intersect((offset, offset + tensor.numel()), (start, start + numel))
            if both is not None:
                yield tensor[both[0] - offset:both[1] - offset], both[0] - start

    def read(self, group: int, kind: str, out: torch.Tensor, start: int = 0) -> None:
        flat = out.view(-1)
        for view, at in self._copies(group, kind, start, flat.numel()):
            flat[at:at + view.numel()].copy_(view)

    def write(self, group: int, kind: str, values: torch.Tensor, start: int = 0) -> None:
        flat = values.reshape(-1)
        for view, at in self._copies(group, kind, start, flat.numel()):
            view.copy_(flat[at:at + view.numel()])

    def state(self, group: int, kind: str) -> torch.Tensor:
        segments = self._state[group][kind]
        if len(segments) == 1 and segments[0][1].device.type == "cpu":
            return segments[0][1].detach()
        out = torch.empty(sum(t.numel() for _, t in segments), dtype=torch.float32)
        self.read(group, kind, out)
        return out

    def account(self, report: MemoryReport) -> None:
        for group in self._state:
            for kind, segments in group.items():
                if kind == MASTER and self.master_is_params:
                    continue  # the store counts them as parameters
                for _, t in segments:
                    report.add("master" if kind == MASTER else "optimizer", t.device.type, t.numel() * t.element_size())

    def io_stats(self) -> dict[str, dict[str, float]]:
        return {}

    def close(self) -> None:
        pass


class NvmeHome:
    """Master and state in files, streamed through the NVMe store's ring of aligned buffers."""

    def __init__(self, root: Path, group_numels: Sequence[int], tile_numel: int, aio: Any, pin: bool,
                 state_kinds: Sequence[Sequence[str]] | None = None) -> None:
        from zerorun.runtime.offload.nvme import NvmeFiles  # the aio kernel builds on first use only

        self.group_numels = list(group_numels)
        self._kinds = group_kinds(state_kinds, len(self.group_numels))
        self.stores = [NvmeFiles(root / f"group-{g}", {name: n for name in kinds}, tile_numel=tile_numel,
                                 aio=aio, pin=pin) for g, (n, kinds) in enumerate(zip(self.group_numels, self._kinds))]
        zeros = torch.zeros(min(max(self.group_numels, default=0), 2**22), dtype=torch.float32)
        for g, numel in enumerate(self.group_numels):  # the state starts at zero; the store writes the master
            for lo in range(0, numel, max(1, zeros.numel())):
                hi = min(numel, lo + zeros.numel())
                for name in self._kinds[g][1:]:
                    self.stores[g].write(name, zeros[:hi - lo], start=lo)

    def kinds(self, group: int) -> tuple[str, ...]:
        return self._kinds[group]

    def read(self, group: int, kind: str, out: torch.Tensor, start: int = 0) -> None:
        self.stores[group].read(kind, out, start=start)

    def write(self, group: int, kind: str, values: torch.Tensor, start: int = 0) -> None:
        self.stores[group].write(kind, values.detach().to("cpu", torch.float32).contiguous(), start=start)

    def state(self, group: int, kind: str) -> torch.Tensor:
        out = torch.empty(self.group_numels[group], dtype=torch.float32)
        self.read(group, kind, out)
        return out

    def window(self, group: int, kind: str, start: int, numel: int, device: torch.device) -> None:
        return None  # in files: read and written through staging

    @property
    def resident(self) -> None:
        return None  # in files

    def place_of(self, group: int, offset: int) -> str:
        return "nvme"

    def visit(self, group: int, spans: Sequence[tuple[int, int]], fn: Visit) -> None:
        index = {lo: k for k, (lo, _) in enumerate(spans)}

        def update(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
            fn(index[lo], views)

        kinds = list(self._kinds[group])
        self.stores[group].for_each_tile(kinds, list(spans), update, write_back=kinds)

    def io_stats(self) -> dict[str, dict[str, float]]:
        """Bytes and seconds of NVMe reads and writes, and the seconds the step waited on them."""
        total = {"nvme_read": {"bytes": 0, "seconds": 0.0}, "nvme_write": {"bytes": 0, "seconds": 0.0},
                 "wait": {"bytes": 0, "seconds": 0.0}}
        for store in self.stores:
            s = store.stats
            total["nvme_read"]["bytes"] += s.bytes_read
            total["nvme_read"]["seconds"] += s.read_s
            total["nvme_write"]["bytes"] += s.bytes_written
            total["nvme_write"]["seconds"] += s.write_s
            total["wait"]["seconds"] += s.wait_s
        return total

    def account(self, report: MemoryReport) -> None:
        report.add("master", "nvme", sum(n * 4 for n in self.group_numels))
        report.add("optimizer", "nvme", sum(n * 4 * (len(kinds) - 1) for n, kinds in zip(self.group_numels, self._kinds)))
        report.add("comm", "cpu", sum(store.held_bytes() for store in self.stores))

    def close(self) -> None:
        for store in self.stores:
            store.close()
