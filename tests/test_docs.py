"""The guide holds together: every relative link and #anchor in README.md and docs/ resolves, as
GitHub renders them, and no dated lab-notebook prose (dates, issue numbers, "Measured today") or
measured figure sits in the docs or the code's docstrings: history belongs in CHANGELOG.md, and
figures in docs/benchmarks.md with the command that reproduces them."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, ROOT / "CHANGELOG.md"]  # the changelog may carry dates, but its links must resolve too
CODE = sorted((ROOT / "zerorun").rglob("*.py")) + sorted((ROOT / "recipes").glob("*.py"))

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (headings and links there are not rendered as such)."""
    return FENCE.sub("", text)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: markup dropped, lower case, punctuation gone, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*_~]|<[^>]+>", lambda m: "_" if m.group(0) == "_" else "", text)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(_prose(page.read_text())):
        base = github_anchor(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return LINK.findall(INLINE_CODE.sub("", _prose(page.read_text())))


def test_github_anchor_follows_githubs_rules() -> None:
    assert github_anchor("Training step: `zerorun bench step`") == "training-step-zerorun-bench-step"
    assert github_anchor("Trackers: TensorBoard, CSV, Weights & Biases, MLflow") == \
        "trackers-tensorboard-csv-weights--biases-mlflow"
    assert github_anchor("Tuner: `zerorun tune --sweep`") == "tuner-zerorun-tune---sweep"
    assert github_anchor("zero.host_memory and RSS") == "zerohost_memory-and-rss"


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif not dest.resolve().is_relative_to(ROOT):
            broken.append(f"{target}: points outside the repository")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n  " + "\n  ".join(broken)


def test_every_guide_page_is_reachable_from_the_readme() -> None:
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target in links(page):
            path = target.partition("#")[0]
            dest = (page.parent / path).resolve() if path else page
            if dest.suffix == ".md" and dest.is_file() and not re.match(r"[a-z]+:", target):
                todo.append(dest)
    missing = [p.name for p in PAGES if p.resolve() not in reached]
    assert not missing, f"guide pages no link leads to: {missing}"


# Lab-notebook prose: when something was measured, which issue asked for it, files outside the project.
DATED = [
    (re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a date"),
    (re.compile(r"\bissue #?\d+", re.I), "an issue reference"),
    (re.compile(r"(?<![\w&/#])#\d+\b"), "an issue reference"),
    (re.compile(r"\bMeasured (today|now|again)\b|\bmeasured (today|yesterday|tonight|this (morning|afternoon|evening))\b"),
     "a dated measurement"),
    (re.compile(r"\bDone-when\b", re.I), "an issue's Done-when"),
    (re.compile(r"\b(at|from|of) (a frozen copy of )?commit [0-9a-f]{7,40}\b"), "a commit a figure was measured at"),
    (re.compile(r"FIELD-NOTES|shared/gpu|gpu_check\.sh"), "a file outside the project"),
]
# A measured figure in a docstring or comment: a step time, a rate or a ratio with its unit, or a
# before -> after. (Plain durations are left alone: "waking every 100 ms" is a setting, not a result.)
FIGURE = re.compile(r"\b\d+(\.\d+)? ?(s a step|s per step|GB/s|MB/s|tokens/s|G params/s|TFLOP/s\b"
                    r"|x DDP|x torch|x fast)|\b\d+(\.\d+)? -> \d+(\.\d+)? ?(MiB|GiB|s\b)")


def _offences(text: str, patterns: list[tuple[re.Pattern[str], str]]) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in patterns:
            match = pattern.search(line)
            if match:
                found.append(f"{number}: {what}: {match.group(0)!r}: {line.strip()[:100]}")
    return found


def test_no_lab_notebook_in_the_readme_or_the_guide() -> None:
    offences = []
    for page in PAGES:
        text = page.read_text()
        # code blocks are exempt from the date rule only: they show what a command prints (a Slurm
        # script's header)
        found = _offences(_prose(text), DATED[:1]) + _offences(text, DATED[1:])
        offences += [f"{page.relative_to(ROOT)}:{line}" for line in found]
    assert not offences, "dated notes belong in CHANGELOG.md:\n" + "\n".join(offences)


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lab_notebook_or_measured_figure_in_the_code(path: Path) -> None:
    source = path.read_text()
    notes = []  # (line, text) of every docstring and comment
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                notes.append((node.body[0].lineno, doc))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            notes.append((tok.start[0], tok.string))
    offences = []
    for start, text in notes:
        for offset, line in enumerate(text.splitlines()):
            for pattern, what in [*DATED, (FIGURE, "a measured figure (name the benchmark instead)")]:
                match = pattern.search(line)
                if match:
                    offences.append(f"{start + offset}: {what}: {match.group(0)!r}: {line.strip()[:100]}")
    assert not offences, f"{path.relative_to(ROOT)}: say why and name the benchmark:\n  " + "\n  ".join(offences)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


MEASURED = re.compile(r"^Measured on (?P<machine>.+?) at `(?P<commit>[0-9a-f]{7,40})`.*?describes\s+"
                      r"(?P<paths>(?:`[^`]+`(?:,\s*)?)+)\.", re.S)


def test_every_gpu_figure_names_its_commit_and_says_when_the_code_it_describes_changed() -> None:
    """docs/gpu.md: each measured section opens with 'Measured on <machine> at `<commit>`; describes `<paths>`.';
    where those paths changed since that commit, the paragraph says 'Stale:' (the figures wait for a GPU machine),
    and where they did not, it does not."""
    page = (ROOT / "docs" / "gpu.md").read_text()
    paragraphs = [p for p in _prose(page).split("\n\n") if p.startswith("Measured on ")]
    assert len(paragraphs) >= 5, "docs/gpu.md: every measured section opens with a 'Measured on ...' line"
    if _git("rev-parse", "HEAD").returncode:
        pytest.skip("not a git checkout: the commits cannot be compared with the code")
    wrong = []
    for paragraph in paragraphs:
        match = MEASURED.match(paragraph)
        assert match, f"docs/gpu.md: not 'Measured on <machine> at `<commit>`; describes `<paths>`.': {paragraph[:120]}"
        commit, paths = match["commit"], re.findall(r"`([^`]+)`", match["paths"])
        assert paths and all((ROOT / p).exists() for p in paths), f"docs/gpu.md: {paths} must be files of the project"
        if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
            continue  # a shallow clone: the commit is not here to compare with
        changed = _git("diff", "--quiet", commit, "HEAD", "--", *paths).returncode != 0
        if changed != ("Stale:" in paragraph):
            wrong.append(f"{match['machine']} at {commit} ({', '.join(paths)}): "
                         + ("the code changed since: re-measure with `zerorun bench gpu`, or say 'Stale:' and why"
                            if changed else "the code is unchanged since, so the figures are current: drop 'Stale:'"))
    assert not wrong, "docs/gpu.md:\n" + "\n".join(wrong)


def test_the_install_page_names_what_each_extra_installs() -> None:
    """Issue 57: docs/installing.md's test extra left out mypy and ruff, which CI installs with it."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    page = (ROOT / "docs" / "installing.md").read_text()
    rows = dict(re.findall(r"^\| `zerorun\[([\w-]+)\]` \| ([^|]+) \|", page, re.M))
    assert set(rows) == set(extras), f"docs/installing.md lists {sorted(rows)}, pyproject has {sorted(extras)}"
    for name, requirements in extras.items():
        named = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in requirements}
        assert {part.strip() for part in rows[name].split(",")} == named, f"zerorun[{name}]: {rows[name]} vs {named}"
