"""Tables that fit the terminal: the width to print at, the launch summary's compact style, and columns left out
in a stated order where even that is too wide.

    out = tables.console()                       # the terminal's width (or COLUMNS), else WIDTH: logs, CI, pipes
    table = tables.compact("title")              # a rule under the header, one space between columns
    dropped = tables.fit(table, out.width, ["buffers", "NVMe/node"])
    out.print(table)
    if dropped: out.print(tables.dropped_note(dropped, out.width))

The launch summary set the rule (`telemetry/console.py`): it fits 120 columns with nothing cut, and a
terminal's own width where there is one. A table printed at a fixed 200 or 250 columns wraps every line
of a narrower terminal into a mess; one squeezed by rich cuts its figures to "…". So a table's narrowest
rendering (every figure whole, text wrapped at its spaces) is measured, and where it is wider than the
console, the columns a command names as least needed go first, said in a note under the table.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

WIDTH = 120  # where no terminal or COLUMNS says otherwise


def console(stderr: bool = False) -> Console:
    """A console at the terminal's width (rich reads it, and COLUMNS where set), else at `WIDTH`."""
    plain = Console(stderr=stderr)
    if plain.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return plain
    return Console(stderr=stderr, width=WIDTH)


def compact(title: str | None = None) -> Table:
    """The launch summary's style: a bold header over a rule, no outer edges and no padding."""
    return Table(title=title, title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False,
                 padding=(0, 0))


def _ranges(table: Table, console: Console) -> list[tuple[int, int]]:
    """(narrowest, widest) of each column of `table`: a figure never splits, text wraps at its spaces."""
    wide = console.options.update_width(10**6)
    out = []
    for column in table.columns:
        measured = [Measurement.get(console, wide, cell) for cell in (column.header, *column.cells)]
        widest = max(m.maximum for m in measured)
        out.append((widest if column.no_wrap else max(m.minimum for m in measured), widest))
    return out


def narrowest(table: Table, console: Console) -> int:
    """The fewest columns `table` (in the `compact` style) takes with no word of any cell cut."""
    return sum(low for low, _ in _ranges(table, console)) + len(table.columns) - 1


def fit(table: Table, width: int, drop: Sequence[str], console: Console | None = None) -> list[str]:
    """Leave out the columns named in `drop`, in that order, until the table fits `width` columns with nothing
    cut, and share the width out so that rich never squeezes a column below its longest word (its own
    collapse takes from the widest column first, whatever that cuts); returns the headers left out."""
    console = console or Console(width=width)
    dropped: list[str] = []
    for header in drop:
        if narrowest(table, console) <= width:
            break
        column = next((c for c in table.columns if c.header == header), None)
        if column is not None:
            table.columns.remove(column)
            dropped.append(header)
    ranges = _ranges(table, console)
    spare = width - (len(ranges) - 1) - sum(low for low, _ in ranges)
    slack = sum(high - low for low, high in ranges)
    if 0 <= spare < slack:  # too wide as it is, narrow enough cut to the words: widths from the words up
        for column, (low, high) in zip(table.columns, ranges):
            column.width = low + spare * (high - low) // slack
    return dropped


def fitted(table: Table, width: int | None, drop: Sequence[str], elsewhere: str = "--json") -> RenderableType:
    """`table` fitted to `width` columns (`fit`) with the note of what it left out; as it is without a width."""
    if width is None:
        return table
    dropped = fit(table, width, drop)
    return Group(table, Text(dropped_note(dropped, width, elsewhere))) if dropped else table


def dropped_note(dropped: Sequence[str], width: int, elsewhere: str = "--json") -> str:
    """The line under a table that lost columns: which, and where to see them."""
    return (f"(left out to fit {width} columns: {', '.join(dropped)}; a wider terminal, COLUMNS=..., or "
            f"{elsewhere} shows them)")
