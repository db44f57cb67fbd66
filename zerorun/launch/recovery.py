"""Recovery: after a failed attempt, run the job again or stop, and why. Pure: no processes, no clock.

    decision = decide(policy, failures, nodes, batch)
    if decision.restart:  # the launcher re-plans on decision.nodes with decision.batch, and goes again

The policy is the recipe's `launch.max_restarts`, `launch.on_node_failure` and `launch.min_nodes`.
In order, a failure ends the job when:
1. the launcher was told to stop (a signal), or nothing failed;
2. it repeats: the same rank (or node) failed at the same step as in the attempt before, which
   a restart from the same checkpoint would only do again (named, with its cause);
3. the restarts are used up (`max_restarts`; 0, the default, never restarts).
Otherwise the job restarts from its latest complete checkpoint (the engine's auto-resume; from
scratch with the same seed when there is none). With `on_node_failure: shrink`, a node whose link
was lost (or that failed the preflight of a restart) is dropped first, down to `min_nodes`. The
global batch (micro-batch x accumulation x ranks) is kept by raising `grad_accum_steps` when the
new world size divides it; when it does not, the job stops and says so rather than train a
different batch silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zerorun.launch.hostfile import Node
from zerorun.launch.outcome import Ending


@dataclass(frozen=True)
class Policy:
    """The recipe's restart settings."""

    max_restarts: int = 0
    on_node_failure: str = "retry"  # retry | shrink
    min_nodes: int = 1


@dataclass(frozen=True)
class Failure:
    """What one attempt's ending said, in the terms recovery decides on."""

    ending: Ending
    cause: str  # the supervisor's line naming the culprit
    exit_code: int
    host: str | None = None  # the culprit's host (a rank's, or the lost node's)
    rank: int | None = None  # the culprit rank, when a rank
    step: int | None = None  # the furthest step any rank reported before the failure (telemetry), if known


@dataclass(frozen=True)
class Batch:
    """The training loop's shape: global batch = micro_batch_size x grad_accum_steps x world size."""

    micro_batch_size: int
    grad_accum_steps: int

    def global_size(self, world_size: int) -> int:
        return self.micro_batch_size * self.grad_accum_steps * world_size


@dataclass(frozen=True)
class Decision:
    """Restart on `nodes` with `batch`, or stop; `reason` says which and why, in one line."""

    restart: bool
    reason: str
    nodes: tuple[Node, ...] = ()
    batch: Batch | None = None
    dropped: tuple[str, ...] = ()  # hosts left out of the next attempt


def policy_warnings(max_restarts: int, on_node_failure: str, checkpoint_dir: str | None, resume: str) -> list[str]:
    """Restart settings that cannot do what they seem to ask, said before the job starts."""
    warnings = []
    if max_restarts and (not checkpoint_dir or resume == "never"):
        why = "no checkpoint.dir" if not checkpoint_dir else "checkpoint.resume is never"
        warnings.append(f"launch.max_restarts is {max_restarts} but {why}: every restart starts again from step 0 "
                        "(set checkpoint.dir and checkpoint.every_steps to resume where it failed).")
    if on_node_failure == "shrink" and not max_restarts:
        warnings.append("launch.on_node_failure is shrink but launch.max_restarts is 0: a failure ends the job "
                        "(shrink applies to restarts; set launch.max_restarts or --max-restarts).")
    return warnings


def decide(policy: Policy, failures: Sequence[Failure], nodes: Sequence[Node], batch: Batch,
           unreachable: Sequence[str] = ()) -> Decision:
    """After `failures` (every attempt's, the latest last), on `nodes` with `batch`: what next.

    `unreachable`: hosts that failed a restart's preflight (only `shrink` can go on without them).
    """
    last = failures[-1]
    if last.ending in (Ending.SUCCESS, Ending.SIGNAL):
        return Decision(False, "the job was stopped" if last.ending is Ending.SIGNAL else "the job finished")
    restarts = len(failures) - 1
    repeat = _repeats(failures)
    if repeat:
        return Decision(False, repeat)
    if restarts >= policy.max_restarts:
        used = f"after {restarts} restart{'s' if restarts != 1 else ''}" if policy.max_restarts else \
            "launch.max_restarts is 0"
        return Decision(False, f"not restarting ({used}): {last.cause}")
    lost = {last.host} if last.ending is Ending.NODE_LOST and last.host else set()
    lost |= set(unreachable)
    if not lost:
        return Decision(True, f"restart {restarts + 1} of {policy.max_restarts} on the same nodes",
                        tuple(nodes), batch)
    if policy.on_node_failure != "shrink":
        if unreachable:
            return Decision(False, f"host(s) {', '.join(sorted(unreachable))} cannot be reached and "
                                   "launch.on_node_failure is retry (shrink would go on without them)")
        return Decision(True, f"restart {restarts + 1} of {policy.max_restarts} on the same nodes, "
                              f"{', '.join(sorted(lost))} included (launch.on_node_failure: retry)", tuple(nodes), batch)
    return _shrink(policy, restarts, nodes, batch, lost)


def _shrink(policy: Policy, restarts: int, nodes: Sequence[Node], batch: Batch, lost: set[str]) -> Decision:
    kept = tuple(node for node in nodes if node.host not in lost)
    dropped = tuple(node.host for node in nodes if node.host in lost)
    if len(kept) < policy.min_nodes or not kept:
        return Decision(False, f"{len(kept)} node(s) would be left without {', '.join(dropped)}, fewer than "
                               f"launch.min_nodes ({policy.min_nodes})", dropped=dropped)
    before = sum(node.nproc for node in nodes)
    after = sum(node.nproc for node in kept)
    total = batch.global_size(before)
    per_step = batch.micro_batch_size * after
    if total % per_step:
        return Decision(False, f"the global batch of {total} samples (micro-batch {batch.micro_batch_size} x "
                               f"accumulation {batch.grad_accum_steps} x {before} ranks) cannot be kept on {after} "
                               f"ranks: {total} is not a multiple of {batch.micro_batch_size} x {after}; not "
                               "training a different batch silently", dropped=dropped)
    shrunk = Batch(batch.micro_batch_size, total // per_step)
    reason = (f"restart {restarts + 1} of {policy.max_restarts} without {', '.join(dropped)}: {len(nodes)} -> "
              f"{len(kept)} nodes, {before} -> {after} ranks; global batch {total} kept: train.micro_batch_size "
              f"{shrunk.micro_batch_size}, train.grad_accum_steps {batch.grad_accum_steps} -> {shrunk.grad_accum_steps}")
    return Decision(True, reason, kept, shrunk, dropped)


def _repeats(failures: Sequence[Failure]) -> str:
    """A line naming the failure when the last two attempts failed at the same place, else ''."""
    if len(failures) < 2:
        return ""
    last, before = failures[-1], failures[-2]
    same_place = (last.rank, last.host, last.step) == (before.rank, before.host, before.step)
    if last.step is None or not same_place or (last.rank is None and last.host is None):
        return ""
    who = f"rank {last.rank} on {last.host}" if last.rank is not None else f"the node on {last.host}"
    return (f"{who} failed again after step {last.step}, as in the attempt before: not restarting a failure that "
            f"repeats ({last.cause})")
