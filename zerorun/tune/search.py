"""Which candidate to measure next, given what has been measured: a pure function of the results so far.

The space is a product (sharding x micro-batch x checkpointing x bucket size) with a few hundred
points on a real job, and a trial costs a process start plus a few steps, so the tuner walks it
instead of sweeping it. The walk relies on what each knob is known to do:

1. **baseline**: the recipe as it is, the reference every other trial is compared with.
2. **sharding**: every stage/offload combination at the recipe's micro-batch, bucket and
   checkpointing (or the nearest variant the estimate lets fit), least offload and lowest stage
   first: these differ by whole collectives and PCIe/NVMe traffic, the largest effects.
3. **micro-batch**: for the `TOP` fastest shardings, micro-batches outward from the recipe's, larger
   first, each direction while it keeps improving (throughput rises with the micro-batch until the
   device is saturated or memory runs out, then falls).
4. **checkpointing**: recomputing activations only adds work, so it is measured only where the
   configuration without it ran out of memory (measured, or by the estimate): there it may let a
   faster sharding or a larger micro-batch fit.
5. **bucket size**: the best so far, bucket sizes outward while improving: a second-order effect
   (overlap granularity against per-call cost), so last.
6. **confirm** (`next_confirmation`): rivals within a few percent of the best are run again, and the
   median of their runs decides.

Throughout, the best so far is measured again after every `RECHECK_EVERY` other runs
(`next_recheck`): a shared machine's load moves, and a best measured in a quiet minute would
otherwise stop every later trial as "slower" (a first trial's repeats can fall to a third of it
once other jobs start, and every later trial would then be stopped early against it).

Early stopping (a trial that cannot beat the best so far is ended after two measured steps) is the
tuner's; this module only orders the work.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace

from zerorun.tune.measure import Status, Trial
from zerorun.tune.space import Candidate, Dimensions

TOP = 2  # shardings whose micro-batches are explored
CONFIRM_WITHIN = 0.10  # trials this close to the best are run again before one is declared the winner
CONFIRM_TOP = 3
CONFIRM_RUNS = 3
RECHECK_EVERY = 4  # other runs after which the best so far is measured again (the machine may have drifted)
MEMORY_FAILURES = (Status.OUT_OF_MEMORY, Status.OVER_BUDGET)


def next_candidate(base: Candidate, dims: Dimensions, trials: Mapping[Candidate, Trial],
                   rejected: Iterable[Candidate]) -> tuple[Candidate, str] | None:
    """The next candidate to run and the phase that wants it; None when the search has nothing left."""
    blocked = set(trials) | set(rejected)
    phases = (("baseline", lambda: [base]), ("sharding", lambda: _shardings(base, dims, rejected)),
              ("micro-batch", lambda: _micro_batches(dims, trials, rejected)),
              ("checkpointing", lambda: _checkpointing(dims, trials, rejected)),
              ("bucket", lambda: _buckets(dims, trials, rejected)))
    for phase, wanted in phases:
        for candidate in wanted():
            if candidate not in blocked and (phase == "baseline" or not _dominated(candidate, trials)):
                return candidate, phase
    return None


def _dominated(candidate: Candidate, trials: Mapping[Candidate, Trial]) -> bool:
    """Checkpointed, while the same configuration without it ran without running out of memory: recomputation
    can only be slower."""
    if not candidate.checkpointing:
        return False
    twin = trials.get(replace(candidate, checkpointing=False))
    return twin is not None and twin.status in (Status.MEASURED, Status.SLOWER)


def next_confirmation(trials: Iterable[Trial]) -> Candidate | None:
    """Once the search is done: a candidate close to the best to measure again, or None.

    One short trial on a shared machine varies by several percent, so when rivals are within
    `CONFIRM_WITHIN` of the best, the `CONFIRM_TOP` of them are run until each has `CONFIRM_RUNS` runs,
    and the median decides. A clear winner (no rival that close) is not repeated.
    """
    trials = list(trials)
    top = best(trials)
    if top is None:
        return None
    rivals = sorted((t for t in trials if t.ok and t.throughput >= (1 - CONFIRM_WITHIN) * top.throughput),
                    key=lambda t: -t.throughput)[:CONFIRM_TOP]
    if len(rivals) < 2:
        return None
    return next((t.candidate for t in rivals if len(t.runs or [t.throughput]) < CONFIRM_RUNS), None)


def next_recheck(trials: Iterable[Trial], runs_so_far: int) -> Candidate | None:
    """The best so far when `RECHECK_EVERY` runs have gone by since it was last measured, else None."""
    top = best(trials)
    if top is None or top.index is None:
        return None
    last = max([top.index, *top.repeats])
    return top.candidate if runs_so_far - last >= RECHECK_EVERY else None


def latest(trial: Trial) -> float:
    """The throughput of a trial's most recent run: the level to compare a new trial with, at today's load."""
    return trial.runs[-1] if trial.runs else (trial.throughput or 0.0)


def best(trials: Iterable[Trial]) -> Trial | None:
    """The fastest measured trial."""
    return max((t for t in trials if t.ok and t.throughput), key=lambda t: t.throughput, default=None)


def _shardings(base: Candidate, dims: Dimensions, rejected: Iterable[Candidate]) -> list[Candidate]:
    """Per sharding, the recipe's settings, or the variant nearest them that the estimate lets fit."""
    rejected = set(rejected)
    picks = []
    for sharding in dims.shardings:
        variants = [Candidate(*sharding, m, a, c, b) for (m, a) in dims.micro_batches for c in dims.checkpointing
                    for b in dims.bucket_mb]
        variants = [v for v in variants if v not in rejected]
        if variants:
            picks.append(min(variants, key=lambda v: _distance(base, v)))
    return picks


def _distance(base: Candidate, v: Candidate) -> tuple:
    """The recipe's micro-batch first, then smaller ones (likelier to fit), checkpointing and bucket as given."""
    return (v.micro_batch != base.micro_batch, v.checkpointing != base.checkpointing, v.micro_batch > base.micro_batch,
            abs(math.log(v.micro_batch / base.micro_batch)), v.bucket_mb != base.bucket_mb)


def _micro_batches(dims: Dimensions, trials: Mapping[Candidate, Trial], rejected: Iterable[Candidate]
                   ) -> list[Candidate]:
    rejected = set(rejected)
    out = []
    for trial in _fastest_per_sharding(trials.values())[:TOP]:
        start = trial.candidate
        pairs = sorted(dims.micro_batches)
        up = [replace(start, micro_batch=m, grad_accum=a) for m, a in pairs if m > start.micro_batch]
        down = [replace(start, micro_batch=m, grad_accum=a) for m, a in reversed(pairs) if m < start.micro_batch]
        out += _walk(_until_rejected(up, rejected), trial, trials)
        out += _walk([c for c in down if c not in rejected], trial, trials)
    return out


def _checkpointing(dims: Dimensions, trials: Mapping[Candidate, Trial], rejected: Iterable[Candidate]
                   ) -> list[Candidate]:
    """Checkpointed twins of candidates that did not fit without it, in expected-speed order."""
    if True not in dims.checkpointing:
        return []
    failed = [t.candidate for t in trials.values() if t.status in MEMORY_FAILURES] + list(rejected)
    twins = {replace(c, checkpointing=True) for c in failed if not c.checkpointing}
    order = {s: i for i, s in enumerate(dims.shardings)}
    return sorted(twins, key=lambda c: (order.get(c.sharding, len(order)), -c.micro_batch, c.bucket_mb))


def _buckets(dims: Dimensions, trials: Mapping[Candidate, Trial], rejected: Iterable[Candidate]) -> list[Candidate]:
    top = best(trials.values())
    if top is None:
        return []
    rejected = set(rejected)
    start, sizes = top.candidate, sorted(dims.bucket_mb)
    up = [replace(start, bucket_mb=b) for b in sizes if b > start.bucket_mb]
    down = [replace(start, bucket_mb=b) for b in reversed(sizes) if b < start.bucket_mb]
    return _walk([c for c in up if c not in rejected], top, trials) + \
        _walk([c for c in down if c not in rejected], top, trials)


def _walk(path: list[Candidate], start: Trial, trials: Mapping[Candidate, Trial]) -> list[Candidate]:
    """The next untried step of `path` as long as every step so far improved on the one before it."""
    previous = start.throughput or 0.0
    for candidate in path:
        trial = trials.get(candidate)
        if trial is None:
            return [candidate]
        if not trial.ok or (trial.throughput or 0.0) <= previous:
            return []
        previous = trial.throughput
    return []


def _until_rejected(path: list[Candidate], rejected: set[Candidate]) -> list[Candidate]:
    """A larger micro-batch needs more memory: past the first the estimate rejects, none fits."""
    out = []
    for candidate in path:
        if candidate in rejected:
            break
        out.append(candidate)
    return out


def _fastest_per_sharding(trials: Iterable[Trial]) -> list[Trial]:
    """The best measured trial of each sharding, fastest first."""
    per: dict[tuple[int, str, str], Trial] = {}
    for t in trials:
        known = per.get(t.candidate.sharding)
        if t.ok and t.throughput and (known is None or t.throughput > known.throughput):
            per[t.candidate.sharding] = t
    return sorted(per.values(), key=lambda t: -t.throughput)
