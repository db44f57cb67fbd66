"""Real launches against hostile input and shared machines: large recipes, a second job on the same paths,
forged telemetry. Each test names what happened before its fix."""

from __future__ import annotations

from pathlib import Path

RECIPE_SCRIPT = """
import os, stat, zerorun
recipe = zerorun.recipe()
path = os.environ["ZERORUN_RECIPE_FILE"]
mode = stat.S_IMODE(os.stat(path).st_mode)
folder = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
print(f"env keys {len(recipe.env)} in env {'ZERORUN_RECIPE' in os.environ} modes {mode:o} {folder:o} at {path}", flush=True)
"""


def test_a_recipe_over_128_kib_launches_through_a_private_file(launch, tmp_path: Path):
    script = tmp_path / "show_recipe.py"
    script.write_text(RECIPE_SCRIPT)
    big = {f"ZR_PAD_{i}": "x" * 1000 for i in range(150)}  # 150 KiB of recipe (before: "Argument list too long")
    job = launch(str(script), nproc_per_node=2, env=big)
    assert job.wait(timeout=120) == 0, job.output
    shown = [line for line in job.stdout if "env keys" in line]
    assert len(shown) == 2 and all("env keys 150 in env False modes 600 700 at " in line for line in shown), job.output
    path = shown[0].rsplit(" at ", 1)[1]
    assert job.job_id in path and not Path(path).exists()  # the job's own place, removed at the end
    assert job.leftovers() == []
