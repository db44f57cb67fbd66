"""A non-editable wheel carries the kernel sources and the console script."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_wheel_ships_kernel_sources_and_console_script(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("zerorun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".h", ".cpp", ".cu"))
    assert sources and all(f"zerorun/kernels/{name}" in names for name in sources), names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "zerorun = zerorun.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


TEST_ONLY = ("pytest", "hypothesis", "matplotlib", "tensorboard", "mypy", "wandb", "mlflow", "transformers",
             "accelerate", "isal", "xdist", "execnet")  # the test extra and the optional ones: none is needed to launch
BLOCKER = f"""
import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {TEST_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: the launch must not need it)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""


@pytest.mark.slow
def test_pip_install_dot_alone_launches_the_quick_start(tmp_path: Path) -> None:
    """`pip install .` installs what a launch needs; the test extra only what the tests need. Every
    package of the extras is hidden from the launcher and its workers (a sitecustomize on PYTHONPATH)."""
    import os

    from tests.launch.launched import subprocess_env

    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(BLOCKER)
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hidden), env["PYTHONPATH"]])
    probe = subprocess.run([sys.executable, "-c", "import matplotlib"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "hidden: the launch must not need it" in probe.stderr
    result = subprocess.run([sys.executable, "-m", "zerorun.cli", "launch", str(ROOT / "recipes/quickstart.yaml"),
                             "--set", "train.steps=4"], env=env, capture_output=True, text=True, cwd=tmp_path,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[localhost:0] done: 4 steps" in result.stdout
    report = subprocess.run([sys.executable, "-m", "zerorun.cli", "report", "runs/quickstart"], env=env,
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert report.returncode == 0 and "matplotlib is not installed" in report.stdout, report.stdout + report.stderr
