"""Values of the command line that click has no type for: counts (`--params 7B`).

typer turns a parser's `typer.BadParameter` into click's usage error naming the flag ("Invalid value
for '--params': ..."), so a mistyped count is refused where it was typed, with the forms it takes.
"""

from __future__ import annotations

import typer

from zerorun.config.counts import parse_count


def count(text: str) -> int:
    """A count as `counts.parse_count` reads it (`7B`, `1.5e9`, `350M`)."""
    if isinstance(text, int):  # a default typer passes through as it is
        return text
    try:
        return parse_count(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
