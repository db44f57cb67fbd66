"""The nearest real flag for an unknown one: `--dryrun` -> `--dry-run`, `--nproc` -> `--set nproc_per_node=N`.

click suggests only what `difflib.get_close_matches` finds above a 0.6 ratio, so `--dryrun` got
`--dry-run` while `--nproc` (torchrun's habit) got nothing. Here every unknown flag gets the one
nearest candidate, whatever its distance: the command's own flags, and, for a command that takes
`--set`, every recipe key as `--set KEY=VALUE` (a flag of another launcher is usually a recipe key
here). Names are compared without dashes and underscores (`--num_gpus` and `--num-gpus` are one
name); a name that starts another counts as near (`--gpus` -> `--gpus-per-node`), and so does another
launcher's word for the same thing (`SYNONYMS`: `zerorun bench step --nproc` -> `--ranks`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX_SCORE = 0.9  # a typed name that starts a candidate's (or the reverse): near, whatever the ratio says
RECIPE_KEY_DISCOUNT = 0.97  # at equal scores a real flag of the command wins over a `--set` of a recipe key
SYNONYM_SCORE = 0.85  # another launcher's word for a flag's meaning: near, below a shared prefix
WEAK_SCORE = 0.5  # below this the nearest flag is only the least far: the message points at --help too
# Words torchrun, DeepSpeed, accelerate, mpirun and Slurm use, grouped by meaning (compared bare).
SYNONYMS = (
    frozenset({"nproc", "nprocpernode", "numprocesses", "np", "npernode", "ntaskspernode", "ranks", "numgpus",
               "gpuspernode", "gpus", "workers", "worldsize"}),
    frozenset({"nnodes", "numnodes", "nodes", "numhosts", "hosts"}),
    frozenset({"dryrun", "noop", "printonly", "plan"}),
)


@dataclass(frozen=True)
class Suggestion:
    """What to type instead, and how near it is (1.0: the same name, spelled otherwise)."""

    text: str
    score: float


def _bare(name: str) -> str:
    return name.lstrip("-").replace("-", "").replace("_", "").replace(".", "").lower()


def _score(typed: str, candidate: str) -> float:
    a, b = _bare(typed), _bare(candidate)
    if not a or not b:
        return 0.0
    if a == b:
        return 1.0
    ratio = difflib.SequenceMatcher(None, a, b).ratio()
    if len(a) >= 3 and (b.startswith(a) or a.startswith(b)):
        return max(ratio, PREFIX_SCORE)
    if any(a in group and b in group for group in SYNONYMS):
        return max(ratio, SYNONYM_SCORE)
    return ratio


def nearest(typed: str, flags: Iterable[str], recipe_keys: Sequence[tuple[str, str]] = ()) -> Suggestion | None:
    """The candidate nearest to `typed`: one of `flags`, or `--set KEY=VALUE` for a (dotted key, type) of
    `recipe_keys` (compared by its whole name and by its last part)."""
    best: Suggestion | None = None
    for flag in flags:
        score = _score(typed, flag)
        if best is None or score > best.score:
            best = Suggestion(flag, score)
    for key, kind in recipe_keys:
        leaf = key.rsplit(".", 1)[-1]
        score = max(_score(typed, key), _score(typed, leaf)) * RECIPE_KEY_DISCOUNT
        if best is None or score > best.score:
            best = Suggestion(f"--set {key}={_placeholder(kind)}", score)
    return best


def _placeholder(kind: str) -> str:
    """What a value of the recipe reference's type looks like on the command line."""
    kind = kind.removesuffix(" or null")
    if kind == "int":
        return "N"
    if kind == "float":
        return "X"
    if kind == "bool":
        return "true"
    if "\\|" in kind:  # a Literal (or a word beside a number): its choices, as the reference lists them
        return "|".join(_placeholder(choice.strip().strip("`\"")) if choice.strip() in ("int", "float")
                        else choice.strip().strip("`\"") for choice in kind.split("\\|"))
    return "VALUE"


def recipe_keys() -> list[tuple[str, str]]:
    """(dotted key, type) of every recipe key that takes a value (sections left out)."""
    from zerorun.config import reference_rows

    return [(key, kind) for key, kind, _, _ in reference_rows() if kind != "section"]


# commands whose --set takes a part of the recipe only: the keys offered there start so (`bench step --nproc` is
# `--ranks`, not the launch's `--set nproc_per_node=N`)
SET_SCOPE = {"bench step": "zero."}


def message(typed: str, flags: Iterable[str], with_recipe_keys: bool, command: str = "") -> str:
    """`No such option: --nproc. The nearest: --set nproc_per_node=N`, as the usage error says it."""
    scope = next((prefix for name, prefix in SET_SCOPE.items() if command.endswith(name)), "")
    keys = [(key, kind) for key, kind in recipe_keys() if key.startswith(scope)] if with_recipe_keys else []
    found = nearest(typed, flags, keys)
    every = f"`{command} --help` lists every option" if command else "--help lists every option"
    if found is None:
        return f"No such option: {typed}; {every}."
    if found.score < WEAK_SCORE:
        return f"No such option: {typed}. The nearest: {found.text}, though not near; {every}."
    return f"No such option: {typed}. The nearest: {found.text}"
