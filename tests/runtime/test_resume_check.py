"""A resume states every value the checkpoint overrides and refuses what cannot be right, through a real save/load."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.harness import run_ranks


def _resume(rank: int, world: int, root: str) -> list[str]:
    import zerorun
    from zerorun import config
    from zerorun.errors import ZerorunError

    def engine(lr: float, weight_decay: float, *overrides: str):
        recipe = config.loads("script: t.py\n", "t.yaml", [f"checkpoint.dir={root}", "checkpoint.resume=never",
                                                           *overrides])
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        return zerorun.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay),
                                  recipe)

    first = engine(1e-3, 0.01)
    first.backward(first(torch.ones(2, 4)).sum())
    first.step()
    first.save_checkpoint()
    seen = []
    same = engine(1e-3, 0.01)
    same.load_checkpoint()  # nothing differs: nothing to say
    changed = engine(5e-4, 0.1)
    changed.load_checkpoint()
    seen.append(f"lr {changed.optimizer.param_groups[0]['lr']:g}")
    for overrides in (["precision=bf16"], ["optimizer.type=adam"]):
        try:
            engine(1e-3, 0.01, *overrides).load_checkpoint()  # the user's optimizer is AdamW: adam is the recipe's
            seen.append("accepted")
        except ZerorunError as exc:
            seen.append(str(exc))
    allowed = engine(1e-3, 0.01, "precision=bf16", "checkpoint.allow_changes=true")
    allowed.load_checkpoint()
    seen.append("allowed")

    def built(*overrides: str):  # the recipe's own optimizer
        recipe = config.loads("script: t.py\n", "t.yaml", [f"checkpoint.dir={root}/built", "checkpoint.resume=never",
                                                           *overrides])
        torch.manual_seed(0)
        return zerorun.initialize(torch.nn.Linear(4, 4), None, recipe)

    built().save_checkpoint()
    try:
        built("optimizer.type=adam").load_checkpoint()
        seen.append("accepted")
    except ZerorunError as exc:
        seen.append(str(exc))
    return seen


def test_resume_states_overridden_values_and_refuses_another_precision_unless_allowed(tmp_path: Path, capfd):
    seen = run_ranks(_resume, 2, (str(tmp_path),))[0]
    assert seen[0] == "lr 0.001"
    assert seen[1].endswith("cannot resume: the checkpoint was saved in precision fp32, this run trains in bf16. "
                            "Resume with the checkpoint's settings, or set checkpoint.allow_changes: true to carry the "
                            "saved state over anyway.")
    # the script's own AdamW beside the recipe's optimizer.type: refused at initialize, before any resume
    assert seen[2].startswith("the recipe sets optimizer.type (--set optimizer.type=adam), but the script passes its "
                              "own AdamW to zerorun.initialize")
    assert seen[3] == "allowed"
    assert seen[4].endswith("cannot resume: the checkpoint's optimizer is AdamW, this run's is Adam. Resume with the "
                            "checkpoint's settings, or set checkpoint.allow_changes: true to carry the saved state over "
                            "anyway.")
    out = capfd.readouterr().out
    assert out.count("zerorun: resuming from step-1: the checkpoint's values replace this run's: lr 0.001 (this "
                     "run: 0.0005); weight_decay 0.01 (this run: 0.1)") == 1, out
    assert out.count("the checkpoint was saved in precision fp32, this run trains in bf16") == 1, out
