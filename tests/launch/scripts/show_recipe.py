"""Prints how this worker got its recipe: how many `env` keys, whether the JSON is still in the
environment, the modes of the file and its directory, and the file's path."""

import os
import stat

import zerorun

recipe = zerorun.recipe()
path = os.environ["ZERORUN_RECIPE_FILE"]
mode = stat.S_IMODE(os.stat(path).st_mode)
folder = stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)
inherited = sorted(key for key in os.environ if key.startswith("ZERORUN_RECIPE") and key != "ZERORUN_RECIPE_FILE"
                   and key != "ZERORUN_RECIPE_SOURCE")
print(f"env keys {len(recipe.env)} in env {inherited or False} modes {mode:o} {folder:o} at {path}", flush=True)
