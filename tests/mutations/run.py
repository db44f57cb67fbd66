"""Apply each mutation of table.py to a copy of the tree and run the tests that must catch it.

A mutation is caught when pytest reports a failed test (exit code 1). Exit code 0 (everything passed) is a mutation
the suite misses; any other (tests not collected, an import error, pytest interrupted) is shown as it is: it says
the mutation no longer applies cleanly or broke something other than the behaviour, which is no proof.
The copy is the working tree's tracked and untracked-but-not-ignored files (`git ls-files`), in a temporary
directory removed afterwards whatever happens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.mutations.table import MUTATIONS, Mutation

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Verdict:
    mutation: Mutation
    code: int
    seconds: float
    failed: str  # the first failed test's line of pytest's summary (or the tail of its output)

    @property
    def caught(self) -> bool:
        return self.code == 1


def copy_tree(into: Path) -> None:
    """The working tree's files, as git sees them (tracked, or untracked and not ignored), under `into`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def apply(mutation: Mutation, tree: Path) -> None:
    """Put the regression back in `tree`: its `fixed` text, found exactly once, replaced by `broken`."""
    path = tree / mutation.path
    text = path.read_text()
    found = text.count(mutation.fixed)
    if found != 1:
        raise SystemExit(f"{mutation.name}: {mutation.path} holds the fixed text {found} times (expected once): "
                         f"update tests/mutations/table.py")
    path.write_text(text.replace(mutation.fixed, mutation.broken))


def pytest_command(mutation: Mutation, tier: bool) -> list[str]:
    where = ["-m", "not slow"] if tier else list(mutation.caught_by)
    # one process: under pytest-xdist, -x ends the session as interrupted (exit code 2), not as failed (1)
    return [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", "--no-header",
            "-rf", *where]


def run(mutation: Mutation, tier: bool) -> Verdict:
    with tempfile.TemporaryDirectory(prefix=f"zerorun-mutation-{mutation.name}-") as directory:
        tree = Path(directory)
        copy_tree(tree)
        apply(mutation, tree)
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        started = time.monotonic()
        done = subprocess.run(pytest_command(mutation, tier), cwd=tree, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - started
    lines = done.stdout.splitlines()
    failed = next((line for line in lines if line.startswith(("FAILED", "ERROR"))), "\n".join(lines[-5:]))
    return Verdict(mutation, done.returncode, seconds, failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutations", description=__doc__)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--tier", action="store_true", help="against the development tier, not the area's files")
    parser.add_argument("--list", action="store_true", help="name each mutation, its fix and its tests, and stop")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"no mutation named {', '.join(sorted(unknown))} (--list names them)")
    if args.list:
        for m in chosen:
            print(f"{m.name} ({m.commit}): {m.regression}\n    {m.path}; caught by {' '.join(m.caught_by)}")
        return 0
    verdicts = []
    for mutation in chosen:
        verdict = run(mutation, args.tier)
        verdicts.append(verdict)
        state = "caught" if verdict.caught else f"NOT CAUGHT (pytest exit code {verdict.code})"
        print(f"{mutation.name}: {state} in {verdict.seconds:.0f} s\n    {verdict.failed}", flush=True)
    missed = [v.mutation.name for v in verdicts if not v.caught]
    print(f"{len(verdicts) - len(missed)} of {len(verdicts)} mutations caught" + (f"; missed: {', '.join(missed)}"
                                                                                  if missed else ""))
    return 1 if missed else 0
