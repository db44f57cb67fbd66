"""The recipe reference: docs/recipes.md's key table, rendered from the schema's dataclasses.

A test (tests/test_readme.py) keeps the page equal to `reference_markdown()`, so the table never
says what the code does not.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal, Union

from zerorun.config.schema import Recipe, literal_text, range_text


def _type_text(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " \\| ".join(map(_type_text, inner))
        return f"{text} or null" if type(None) in args else text
    if origin is Literal:
        return " \\| ".join(map(literal_text, args))
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return ""
    return f"`{json.dumps(value)}`"


def reference_rows(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, doc) for every recipe key, depth first."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp = hints[f.name]
        doc = f.metadata.get("doc", "")
        if f.metadata.keys() & {"ge", "gt", "le", "lt"}:
            doc += f" Must be {range_text(f.metadata)}."
        if dataclasses.is_dataclass(tp):
            short = getattr(tp, "__shorthand__", None)
            if short:
                doc += f" May be given as just the `{short}` value."
            rows.append((f"{prefix}{f.name}", "section", "", doc))
            rows.extend(reference_rows(typing.cast(type, tp), f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", _type_text(tp), _default_text(f), doc))
    return rows


def reference_markdown() -> str:
    """The recipe reference table of docs/recipes.md."""
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{k}` | {t} | {d} | {doc} |" for k, t, d, doc in reference_rows()]
    return "\n".join(out) + "\n"
