"""A non-editable wheel carries the kernel sources and the console script."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

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
