"""What a resume changes: the checkpoint's optimizer values and formats against the run that loads them.

A resume restores the checkpoint's hyper-parameters over the ones this run was built with (the
recipe's `optimizer.*`, or the script's own optimizer): a user who changed the learning rate in
the recipe and resumed got the checkpoint's, without a word. Now:
- **stated** (rank 0 prints one line): every lr, weight_decay, betas and eps the checkpoint
  overrides, per param group (a torch scheduler's base `initial_lr` is compared where there is one,
  so a warm-up in progress is not reported as a change);
- **refused**: what cannot be right: another optimizer class for a param group (Adam's moments under
  AdamW's decoupled decay, SGD's momentum under Lion) or another precision, unless the recipe says
  `checkpoint.allow_changes: true` (then stated too; the state each kind of optimizer keeps under the
  same name, such as `exp_avg`, is carried over, the rest starts fresh).
`checkpoint.load` calls `check` before anything is restored.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zerorun.errors import ZerorunError
from zerorun.runtime.checkpoint.manifest import optimizer_groups

COMPARED = ("lr", "weight_decay", "betas", "eps")
ALLOW_KEY = "checkpoint.allow_changes"


def check(engine: Any, manifest: dict[str, Any], path: Path) -> list[str]:
    """Raise ZerorunError for a change that cannot be right unless allowed; the changes in words."""
    changes = _refusable(engine, manifest)
    if changes and not engine.recipe.checkpoint.allow_changes:
        raise ZerorunError(f"{path}: cannot resume: {'; '.join(changes)}. Resume with the checkpoint's settings, or "
                           f"set {ALLOW_KEY}: true to carry the saved state over anyway.")
    changes += _overridden(engine.optimizer.param_groups, manifest["optimizer"]["param_groups"])
    if changes and engine.comm.rank == 0:
        print(f"zerorun: resuming from {path.name}: the checkpoint's values replace this run's: {'; '.join(changes)}",
              flush=True)
    return changes


def _refusable(engine: Any, manifest: dict[str, Any]) -> list[str]:
    out = []
    saved, here = manifest["precision"], engine.recipe.precision.dtype
    if saved != here:
        out.append(f"the checkpoint was saved in precision {saved}, this run trains in {here}")
    saved = [g["class"] for g in optimizer_groups(manifest)]
    here = engine.update.classes()
    for g, (there, ours) in enumerate(zip(saved, here)):
        if there != ours:
            where = f" (param group {g})" if len(here) > 1 else ""
            out.append(f"the checkpoint's optimizer is {there}, this run's is {ours}{where}")
    return out


def _overridden(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> list[str]:
    out = []
    for index, (group, saved) in enumerate(zip(groups, saved_groups)):
        where = f" (param group {index})" if len(groups) > 1 else ""
        for key in COMPARED:
            here, there = _value(group, key), _value(saved, key)
            if here is not None and there is not None and not _same(here, there):
                out.append(f"{key} {_text(there)} (this run: {_text(here)}){where}")
    return out


def _value(group: dict[str, Any], key: str) -> Any:
    return group.get("initial_lr", group.get("lr")) if key == "lr" else group.get(key)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    except (TypeError, ValueError):
        return bool(a == b)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)

