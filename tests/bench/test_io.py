"""`zerorun bench io`: ours and the dd baseline on the same file, side by side, in one short run."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from zerorun.bench import io
from zerorun.cli import app


def test_bench_io_reports_ours_next_to_dd_with_the_ratio(direct_io_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "io.json"
    disk = direct_io_dir / "disk"
    disk.mkdir()
    result = CliRunner().invoke(app, ["bench", "io", "--path", str(disk), "--size-mb", "16", "--rounds", "1",
                                      "--block-sizes", "1M", "--queue-depths", "4", "--backends", "libaio,python",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "x best write baseline" in result.output and "best ours" in result.output
    rows = json.loads(out.read_text())["results"]
    assert {(r["tool"], r["backend"]) for r in rows} >= {("zerorun", "libaio"), ("zerorun", "python"), ("dd", "sync")}
    assert all(len(r["write_gb_s"]) == len(r["read_gb_s"]) == 1 and r["read_gb_s"][0] > 0 for r in rows)
    assert list(disk.iterdir()) == []  # the bench file is gone


def test_bench_io_refuses_bad_arguments(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "io", "--path", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "--path: " in result.output and "does not exist" in result.output
    result = runner.invoke(app, ["bench", "io", "--path", str(tmp_path), "--backends", "uring"])
    assert result.exit_code != 0 and "--backends: unknown uring" in result.output


def test_block_sizes_parse_as_powers_of_two() -> None:
    assert [io.parse_bytes(s) for s in ("1M", "8MiB", "512K", "4096")] == [2**20, 8 * 2**20, 2**19, 4096]
