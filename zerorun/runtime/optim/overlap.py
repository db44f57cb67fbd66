"""The host optimizer under the backward (`zero.overlap_optimizer`): speculate, then validate, exactly.

With the optimizer state on the host, a step used to run in two halves that waited for each other:
the GPU computed the backward while the host sat idle, then the host ran Adam while the GPU sat
idle. Here each unit's piece is updated as soon as its reduced gradient is final, during the
backward of the window's last micro-batch:

    backward (training thread)          worker thread (this module)
    unit k's reduce-scatter lands  -->  gradient tile to the host, back up the tile's state,
    ... backward goes on ...            Adam on the host, updated parameters back to the device

The update of a step depends on every gradient, though: gradient clipping scales the whole step by
the global norm, and a non-finite gradient anywhere (an fp16 overflow) skips it. So the update is
speculative: it assumes the step is applied as is (no clip, no skip, the hyper-parameters of the
backward's start). `engine.step()` computes what the step really is; when it matches (the common
case) the speculation is the step. When it does not (the norm says clip, a gradient is not finite,
a scheduler or the script changed a learning rate in between, `clip_grad_value_` clamps), every
touched tile is restored from its backup, bit for bit, its parameters are re-cast from the restored
master, and the step runs as without the overlap. Either way the result is bit-identical to
`overlap_optimizer: false` (tests/runtime/test_overlap_optimizer.py).

The backup is a copy of each touched tile's master and moments made just before its update: host
memory for this rank's whole optimizer state once more (12 bytes per parameter of the shard, reported
as "backup"; `zerorun estimate` counts it), and one more read and write of it per step on the
host, which the backward hides. Where host memory is the wall (the largest models on one GPU), `auto`
leaves the optimizer after the backward and says why (`overlaps`). Anything that reads or changes the state between the backward and
`step()` (a state dict, a checkpoint, `gathered()`, a forward, another backward, `zero_grad()`)
first rolls the speculation back, so it sees the state as it was.

The owner way's parameters (Muon's matrices, Adafactor's, LAMB's: owner_step.py) are stepped under the
backward on the same worker, unit by unit, with a backup of their own (owner_overlap.py says what
more that assumes, and how it is checked).

What it did is told, not assumed: rank 0 says at the start that it runs, each step's telemetry
carries `offload["overlap"]` (speculations applied and rolled back, the seconds of host updates run under
the backward and the seconds `step()` still waited for them) and `offload["overlap_rollbacks"]` (why, by
reason), the launch summary prints both, rank 0 warns once per reason a step was rolled back, and a
profile window shows the ranges `zerorun.overlap update` and `zerorun.overlap rollback`.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.optim.flat_step import FlatStep, FusedAdam, Piece, Tile
from zerorun.runtime.optim.owner_overlap import OwnerSpeculation
from zerorun.runtime.ranges import Ranges

OverlapSetting = Any  # Literal["auto", True, False], as the recipe spells it


# Why a speculation was rolled back (telemetry's `overlap_rollbacks` keys, the summary's words).
ROLLBACK_REASONS = {
    "clipped": "the step was clipped (train.clip_grad_norm or the script's clip_grad_norm_)",
    "clamped": "the script clamped the gradients (clip_grad_value_)",
    "skipped": "the step was skipped (inf/nan in the gradients)",
    "hyper": "a learning rate or another hyper-parameter changed between the backward and step()",
    "read": "the state was read or changed before step() (a state dict, checkpoint, gathered(), forward, backward "
            "or zero_grad)",
    "whole": "a handed-over optimizer keeps state beyond its parameters' (a param group entry or a number of its "
             "own changed in its step), so it cannot be stepped unit by unit: it steps after the backward from now on",
}
BACKUP_SHARE = 0.5  # auto: the backup may take at most this share of the host memory available to a rank


def overlaps(setting: OverlapSetting, offload: str, state_numel: int, device: torch.device,
             say: Callable[[str], None] | None = None) -> bool:
    """Whether the host optimizer runs under the backward: where the optimizer state is in host memory (the recipe
    refuses true elsewhere) and, for auto, beside a GPU (on a CPU-only machine the "device" computing the backward
    is the same cores: there is nothing to overlap) and where its backup (12 bytes per element of this rank's
    state) fits in BACKUP_SHARE of the host memory available to each rank of the node; `say` tells why not, once."""
    if offload != "cpu" or setting is False:
        return False
    if setting is True:
        return True
    if device.type == "cpu":
        return False
    import psutil

    backup = 12 * state_numel
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    available = psutil.virtual_memory().available / local
    if backup <= BACKUP_SHARE * available:
        return True
    if say is not None:
        say(f"zero.overlap_optimizer: auto runs the host optimizer after the backward, not under it: its backup of "
            f"the optimizer state ({backup / 2**30:.1f} GiB per rank) would take more than {BACKUP_SHARE:.0%} of the "
            f"host memory available per rank ({available / 2**30:.1f} GiB). Set it to true to insist.")
    return False


class FusedArguments(Protocol):
    """A fused Adam group's kernel arguments (update.py's `FusedGroup`)."""

    def arguments(self, grad_divisor: float) -> dict[str, Any]:
        """The next update's arguments as they stand now, not counted."""

    def kernel(self, grad_divisor: float) -> FusedAdam:
        """The next update's kernel, counted."""


@dataclass
class Speculation:
    """One window's speculative update: what it assumed, and which tiles it changed."""

    divisor: float  # world size x loss scale: the step applied unclipped
    hypers: dict[int, dict[str, Any]]  # per fused group, the kernel's arguments it used (`FusedGroup.arguments`)
    touched: dict[int, list[Tile]] = field(default_factory=dict)  # per group, the tiles updated
    pending: list[Future] = field(default_factory=list)
    groups_updated: set[int] = field(default_factory=set)


class OverlappedUpdate:
    """Runs the fused groups' update per unit on a worker thread while the backward goes on (module docstring)."""

    def __init__(self, update: FlatStep, fused: Mapping[int, FusedArguments], pieces: dict[int, list[Piece]],
                 piece_of_unit: list[Piece | None], group_numels: list[int], ranges: Ranges | None = None,
                 owned: OwnerSpeculation | None = None) -> None:
        """`fused`: the fused Adam groups; `pieces`: per fused group, every piece of the step; `piece_of_unit`: the
        piece of each of the store's units, by unit index (None: not a fused group's); `owned`: the owner way's
        units, stepped under the backward too (owner_overlap.py). Pieces whose state is on the device
        (`offload_optimizer_ratio` < 1) are updated at `commit`; the elementwise way's groups, after it."""
        self.update, self.fused, self.owned = update, fused, owned
        self._owned_units = owned.units if owned is not None else set()
        self._owned_done: list[Any] = []  # CUDA: an event after each unit's owned step, for step()'s stream to wait on
        self.pieces, self.piece_of_unit = pieces, piece_of_unit
        self.group_numels = group_numels
        self.ranges = ranges or Ranges()  # the runtime's: the worker's updates and rollbacks in a profile's trace
        self._backup: dict[int, dict[str, torch.Tensor]] | None = None  # per group, per kind: allocated at first use
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerorun-overlap")
        self.current: Speculation | None = None
        self.rollbacks = 0  # speculations that step() did not apply as they were (telemetry, tests)
        self.applied = 0
        self.reasons: Counter[str] = Counter()  # rollbacks by ROLLBACK_REASONS key
        self.updated_s = 0.0  # the worker's seconds of host updates (under the backward, unless waited for)
        self.waited_s = 0.0  # the seconds step() (or a rollback) waited for them
        self.warn: Callable[[str], None] | None = None  # told once per reason a speculation is rolled back (rank 0)

    # -- during the backward --------------------------------------------------------------------
    def begin(self, divisor: float) -> None:
        """The window's last backward starts: units reduced from now on are updated at once."""
        assert self.current is None, "a speculation is pending: step() or a rollback ends it first"
        hypers = {g: group.arguments(divisor) for g, group in self.fused.items()}
        self.current = Speculation(divisor, hypers, {g: [] for g in self.fused})
        if self.owned is not None:
            self.owned.begin(divisor)

    def unit_reduced(self, k: int) -> None:
        """Unit k's gradient piece is final (its reduction has been waited for, on the training thread)."""
        spec = self.current
        if spec is None:
            return
        piece = self.piece_of_unit[k]
        if piece is not None and piece.numel and not self.update.on_device(piece):
            ready = _device_event(piece.grad)
            spec.pending.append(self._submit(self._update, spec, piece, ready))
        if self.owned is not None and k in self._owned_units:
            spec.pending.append(self._submit(self._step_owned, k, _device_event(self.owned.owner.piece_of[k].grad)))

    def _submit(self, work: Callable[..., None], *args: Any) -> Future:
        """Run `work(*args)` on the worker, timed and named, in this thread's context (the runtime's guards see it)."""
        return self._worker.submit(contextvars.copy_context().run, self._timed, work, *args)

    def _timed(self, work: Callable[..., None], *args: Any) -> None:
        started = time.perf_counter()
        with self.ranges.named("overlap update"):
            work(*args)
        self.updated_s += time.perf_counter() - started

    def _step_owned(self, k: int, ready: Any) -> None:
        if ready is not None:  # the worker's stream waits for the gradient's reduction, as the training thread did
            torch.cuda.current_stream().wait_event(ready)
        assert self.owned is not None
        self.owned.step_unit(k)
        if ready is not None:  # and what reads the new parameters after step() waits for the worker's stream
            self._owned_done.append(_device_event(self.owned.owner.piece_of[k].grad))

    def _update(self, spec: Speculation, piece: Piece, ready: Any) -> None:
        backup = self._backups()[piece.group]

        def save(k: int, span: tuple[int, int], views: dict[str, torch.Tensor]) -> None:
            lo, hi = span
            for name, tensor in views.items():
                backup[name][lo:hi].copy_(tensor)

        tiles = self.update.run_pieces(piece.group, [piece], FusedAdam(spec.hypers[piece.group]), after=ready,
                                       before=save)
        spec.touched[piece.group].extend(tiles)
        spec.groups_updated.add(piece.group)

    def _backups(self) -> dict[int, dict[str, torch.Tensor]]:
        if self._backup is None:
            self._backup = {g: {name: torch.empty(self.group_numels[g], dtype=torch.float32)
                                for name in self.update.home.kinds(g)} for g in self.fused}
        return self._backup

    # -- at step() ------------------------------------------------------------------------------
    def settle(self) -> Speculation | None:
        """Wait for every update in flight (their copies to the device included); the speculation, if any."""
        spec = self.current
        if spec is None:
            return None
        started = time.perf_counter()
        for future in spec.pending:
            future.result()  # an update's error is raised here, on the training thread
        self.waited_s += time.perf_counter() - started
        spec.pending.clear()
        for event in self._owned_done:
            torch.cuda.current_stream().wait_event(event)
        self._owned_done.clear()
        self.update.finish()
        return spec

    def mismatch(self, divisor: float, clamped: bool) -> str | None:
        """Why the step `step()` is about to run is not the one speculated (a ROLLBACK_REASONS key); None: it is."""
        spec = self.current
        assert spec is not None and not spec.pending, "settle() first"
        owned = self.owned.mismatch() if self.owned is not None else None  # first: it learns who steps whole
        if clamped:
            return "clamped"
        if divisor != spec.divisor:
            return "clipped"
        if any(spec.hypers[g] != self.fused[g].arguments(divisor) for g in spec.groups_updated):
            return "hyper"
        return owned

    def commit(self) -> None:
        """The speculation is the step: count it for every fused group, as a step does, and update the pieces it did
        not (those whose state is on the device) with the same arguments."""
        spec = self.current
        assert spec is not None and not spec.pending, "settle() first"
        for g, pieces in self.pieces.items():
            if any(piece.numel for piece in pieces):
                kernel = self.fused[g].kernel(spec.divisor)
                rest = [piece for piece in pieces if not any(piece is done for done, _, _ in spec.touched[g])]
                if rest:
                    self.update.run_pieces(g, rest, kernel)
        self.update.finish()
        if self.owned is not None:
            self.owned.commit(spec.divisor)
        self.current = None
        self.applied += 1

    def rollback(self, reason: str = "read") -> None:
        """Restore every touched tile's state from its backup and its parameters from the restored master."""
        spec = self.settle()
        if spec is None:
            return
        with self.ranges.named("overlap rollback"):
            self._restore(spec)
        self.rollbacks += 1
        self.reasons[reason] += 1
        if self.reasons[reason] == 1 and self.warn is not None:
            self.warn(f"zerorun: zero.overlap_optimizer: a host update made under the backward was rolled back and the "
                      f"step run again after it: {ROLLBACK_REASONS[reason]}. Exact either way; where it happens at "
                      f"most steps the overlap hides nothing (the summary counts them). Said once per reason.")

    def _restore(self, spec: Speculation) -> None:
        for g, tiles in spec.touched.items():
            if tiles:
                saved = self._backups()[g]

                def from_backup(lo: int, hi: int, kind: str, saved: dict[str, torch.Tensor] = saved) -> torch.Tensor:
                    return saved[kind][lo:hi]
                self.update.restore(g, tiles, from_backup)
        self.update.finish()
        if self.owned is not None:
            self.owned.restore()
        self.current = None

    def stats(self) -> dict[str, dict[str, float]]:
        """Telemetry's `overlap` and `overlap_rollbacks` entries (cumulative, module docstring)."""
        out = {"overlap": {"applied": float(self.applied), "rolled_back": float(self.rollbacks),
                           "seconds": self.updated_s, "waited": self.waited_s}}
        if self.owned is not None:  # the owner way's parameters stepped under the backward, in steps applied
            out["overlap"]["owned"] = float(self.owned.stepped)
        if self.reasons:
            out["overlap_rollbacks"] = {reason: float(n) for reason, n in self.reasons.items()}
        return out

    def account(self, report: MemoryReport) -> None:
        if self._backup is not None:
            report.add("backup", "cpu", sum(t.numel() * 4 for group in self._backup.values() for t in group.values()))
        if self.owned is not None:
            for device, nbytes in self.owned.backup_bytes().items():
                report.add("backup", device, nbytes)

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _device_event(tensor: torch.Tensor) -> Any:
    """An event recorded now on `tensor`'s device stream (CUDA), for the copy that reads it to wait on."""
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event
