"""Tables fit the terminal as the launch summary does (zerorun/tables.py): estimate, tune and bench step at
COLUMNS 120 and 80 keep every line within the width, cut no figure, and say which columns they left out."""

from __future__ import annotations

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.bench.test_step import _fake_run_ranks
from tests.tune.test_output import RECIPES, _result, _trials
from zerorun.bench import step
from zerorun.cli import app
from zerorun.tune import output

WIDTHS = (120, 80)


def _fits(text: str, width: int) -> None:
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width, "\n".join(lines)
    assert "…" not in text, text  # rich cuts a squeezed cell to "…": no figure may lose digits


@pytest.mark.parametrize("width", WIDTHS)
def test_the_estimate_table_fits_columns_and_keeps_every_figure_whole(width: int) -> None:
    """Issue 57: `zerorun estimate` printed 174 columns whatever the terminal."""
    result = CliRunner().invoke(app, ["estimate", "--params", "70B", "--gpus-per-node", "8", "--gpu-mem", "80",
                                      "--precision", "bf16", "--cpu-mem", "1024"], env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    table = result.output.split("Recommended:")[0]
    _fits(table, width)
    assert "1173.52" in table and "whole" in table and "sharded" in table  # the GPU total and the build
    if width == 80:
        assert "(left out to fit 80 columns: buffers" in " ".join(table.split())


@pytest.mark.parametrize("width", WIDTHS)
def test_the_tune_table_fits_columns(width: int) -> None:
    """Issue 57: `zerorun tune`'s table was 200 columns wide."""
    console = Console(width=width, record=True)
    console.print(output.render_final(_result(RECIPES / "quickstart.yaml", _trials()), "t.yaml", width))
    text = console.export_text()
    table = text.split("Fastest that fits")[0]
    _fits(table, width)
    assert "t04" in table and "1,250" in table and "t.yaml" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_the_bench_step_table_fits_columns(width: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 57: `zerorun bench step` printed 249 columns."""
    monkeypatch.setattr(step, "run_ranks", _fake_run_ranks)
    result = CliRunner().invoke(app, ["bench", "step", "--systems", "ddp,ddp-fused,zero1", "--rounds", "1"],
                                env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("step time: GPT"):]
    _fits(table, width)
    assert "0.45" in table  # zero1's ratio to DDP
