"""What a stopped job prints: for a failed rank, its line and its whole traceback first, then one line per victim
(their full text, and torchrun's report, go to the failure log); for a lost or failed node, its last lines."""

from __future__ import annotations

import textwrap
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from zerorun import tables
from zerorun.launch.held_output import HeldOutput
from zerorun.launch.outcome import Ending, Outcome, Output
from zerorun.launch.streams import RankExit

CULPRIT_LINES = 200  # of the culprit's traceback shown (the rest, if any, in the failure log)
ERROR_PREFIX = b"zerorun: error: "  # a ZerorunError a worker printed (see `worker`): shown once per job
# A script that takes no --local_rank fails on the one its DeepSpeed-style launch gave it, in its last line:
# argparse's "unrecognized arguments: --local_rank=0", a configurator's "Unknown config key: local_rank".
LOCAL_RANK = b"local_rank"
LOCAL_RANK_HINT = ("the script was given --local_rank=<its local rank> before its own arguments, as DeepSpeed's "
                   "launcher does (launch.deepspeed_local_rank), and its last line names it. A script that does not "
                   "take it runs with `zerorun launch --no_local_rank script.py ...`, or with "
                   "`deepspeed_local_rank: false` under `launch:` in its recipe")


class FailureReport:
    """The supervisor's record of a job's output, turned into its ending's report."""

    def __init__(self, job_id: str, output: Output, held: HeldOutput,
                 tails: dict[tuple[str, int | str], deque[bytes]], failure_log: Path | None,
                 local_rank_arg: bool = False) -> None:
        """`local_rank_arg`: the script was given `--local_rank=N` before its own arguments (DeepSpeed's habit)."""
        self.job_id, self.output, self._held, self._tails, self.failure_log = job_id, output, held, tails, failure_log
        self.local_rank_arg = local_rank_arg

    def report(self, outcome: Outcome, failures: Sequence[RankExit]) -> None:
        if outcome.ending is Ending.RANK_FAILED:
            self._report_rank_failure(outcome, failures)
        else:  # no rank to blame: what was held is printed as it came
            for fd, line in self._held.release_all():
                self.output.write(fd, line)
        if outcome.ending in (Ending.NODE_FAILED, Ending.NODE_LOST):
            assert outcome.host is not None
            tail = self._tails[(outcome.host, "torchrun")]
            self._failure_block(outcome.cause, list(tail), f"last {len(tail)} lines of the node on {outcome.host}")
        if outcome.ending is not Ending.SUCCESS:
            self._say(f"job {self.job_id} stopped: {outcome.cause}; exit code {outcome.exit_code}")

    def _report_rank_failure(self, outcome: Outcome, failures: Sequence[RankExit]) -> None:
        """The culprit's line and its whole traceback first; then one line per victim, whose full text goes
        to the failure log with torchrun's report."""
        assert outcome.rank is not None and outcome.host is not None
        culprit = (outcome.host, outcome.rank)
        tail, held = self._tails[culprit], self._held.lines(culprit)
        if not (tail and tail[-1].split(b"] ", 1)[-1].startswith(ERROR_PREFIX)):  # the one line says it all
            shown = held[-CULPRIT_LINES:] if held else list(tail)
            what = f"the traceback of rank {outcome.rank}" if held else f"last {len(tail)} lines of rank {outcome.rank}"
            self._failure_block(outcome.cause, shown, what)
        for line in outcome.evidence:
            self._say(f"evidence: {line}")
        if self.local_rank_arg and tail and LOCAL_RANK in tail[-1].split(b"] ", 1)[-1]:
            self._say(LOCAL_RANK_HINT)
        failed = {(f.host, f.rank): f for f in failures}
        held_ranks = [(host, who) for host, who in self._held.keys() if isinstance(who, int)]
        victims = sorted({key for key in (*failed, *held_ranks) if key != culprit}, key=lambda key: key[1])
        for host, rank in victims:
            exited = failed.get((host, rank))
            how = self._held.exception((host, rank)) or (exited.describe() if exited else "printed a traceback")
            self._say(f"rank {rank} on {host} (a victim): {how}")
        written = self._write_failure_log(outcome, [culprit, *victims])
        if written and (victims or any(key[1] == "torchrun" for key in self._held.keys())):
            self._say(f"the whole output of every failed rank, and torchrun's report: {written}")

    def _write_failure_log(self, outcome: Outcome, ranks: list[tuple[str, int]]) -> str | None:
        """Every failed rank's held output (else its last lines) and torchrun's, to `failure_log`."""
        if self.failure_log is None:
            return None
        keys: list[tuple[str, int | str]] = [*ranks, *(key for key in self._held.keys() if key[1] == "torchrun")]
        text = [f"job {self.job_id} stopped: {outcome.cause}; exit code {outcome.exit_code}".encode()]
        for host, who in keys:
            name = "torchrun" if who == "torchrun" else f"rank {who}"
            text.append(f"\n==== {name} on {host} ====".encode())
            text.extend(self._held.lines((host, who)) or list(self._tails[(host, who)]))
        try:
            self.failure_log.parent.mkdir(parents=True, exist_ok=True)
            self.failure_log.write_bytes(b"\n".join(text) + b"\n")
        except OSError as exc:
            self._say(f"warning: cannot write {self.failure_log} ({exc.strerror or exc})")
            return None
        return str(self.failure_log)

    def _failure_block(self, title: str, lines_shown: list[bytes], what: str) -> None:
        """The title between rules, within `tables.WIDTH` columns as the summary is (a long cause wraps)."""
        rule = "=" * max(4, min(20, (tables.WIDTH - len(title) - 2) // 2))
        heading = textwrap.wrap(title, tables.WIDTH - 2 * len(rule) - 2)
        lines = [f"{rule} {part.ljust(len(heading[0]))} {rule}".encode() for part in heading]
        if lines_shown:
            lines.append(f"{what}:".encode())
            lines.extend(lines_shown)
        else:
            lines.append(f"{what.split(' of ', 1)[-1]} printed nothing.".encode())
        lines.append(b"=" * len(lines[0]))
        for line in lines:
            self.output.write(2, line)

    def _say(self, message: str) -> None:
        self.output.write(2, f"zerorun: {message}".encode())
