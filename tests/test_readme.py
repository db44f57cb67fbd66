"""The README and the guide cannot drift: the recipe reference, quick start and test command are checked."""

from __future__ import annotations

import re
from pathlib import Path

from zerorun import config

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
RECIPES = (ROOT / "docs/recipes.md").read_text()
TEST_COMMAND = "python -m pytest -q"


def test_recipe_reference_equals_the_dataclasses() -> None:
    section = re.search(r"<!-- recipe-reference:start -->\n(.*?)<!-- recipe-reference:end -->", RECIPES, re.S)
    assert section, "docs/recipes.md lost its recipe-reference markers"
    assert section.group(1).strip() == config.reference_markdown().strip(), (
        "docs/recipes.md's recipe reference is stale: regenerate it with "
        "python -c 'from zerorun import config; print(config.reference_markdown())'")


def test_quick_start_is_two_commands_and_ci_runs_the_readme_test_command() -> None:
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    # `pip install .` alone launches (tests/test_packaging.py); the test extra is for the tests
    assert commands == ["pip install . && zerorun launch recipes/quickstart.yaml",
                        f'pip install ".[test]" && {TEST_COMMAND}']
    assert (ROOT / "recipes/quickstart.yaml").is_file()
    assert TEST_COMMAND in (ROOT / ".ci/run").read_text()


def test_readme_is_a_front_page() -> None:
    assert README.count("\n") <= 250, "README.md is the front page: move details into docs/"


def test_the_torch_floor_is_the_torch_ci_runs_and_the_readme_says_it() -> None:
    """Issue 57: pyproject said torch>=2.6 while CI tested 2.13 only: the oldest torch accepted is the oldest tested."""
    ci = (ROOT / ".ci/run").read_text()
    pinned = re.search(r"pip install -q (?:--\S+ )*torch==(\d+\.\d+)", ci)
    floor = re.search(r'"torch>=(\d+\.\d+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and floor and pinned.group(1) == floor.group(1), (pinned, floor)
    assert '-m pytest -q -m "not slow"' in ci.split(f"torch=={pinned.group(1)}", 1)[1]  # and the newest torch, after
    for page in ("README.md", "docs/installing.md"):
        assert f"PyTorch >= {floor.group(1)}" in (ROOT / page).read_text(), page
