"""Change a few keys of a YAML recipe in its own text, keeping every comment, blank line and key order.

    text = set_keys(text, {"zero.stage": (3, "1.21x yours")})   # stage: 3  # tuned: 1.21x yours

PyYAML loses comments on a round trip, and a recipe's comments are its documentation, so this edits
the text where `yaml.compose` says each value lies: a scalar is replaced in place and the comment
appended to its line; a missing key is inserted after the last line of its mapping with that
mapping's indentation (or before the `}` of a flow mapping); a missing section is appended; a
shorthand scalar (`offload_optimizer: cpu`) becomes a flow mapping when another of its keys is set.
Each change re-reads the text, so the positions are never stale. Pure: text in, text out.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from zerorun import config

COMMENT_MARK = "tuned:"
_PLAIN = re.compile(r"[A-Za-z_./~-][\w./~-]*\Z")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "none", "~", ""}


def set_keys(text: str, changes: dict[str, tuple[Any, str]]) -> str:
    """`text` with each dotted key set to its value, `# tuned: comment` ("" for none) on the value's line."""
    for key, (value, comment) in changes.items():
        text = _set_key(text, key.split("."), value, comment)
    return text


def restate_stage(text: str, old: int, new: int) -> str:
    """The recipe's leading comment lines with `stage <old>` said as `stage <new> (tuned; was <old>)`: a header
    that describes the recipe ("ZeRO stage 2") would otherwise contradict the tuned `stage:` below it. Only the
    stage: how a header words the other keys cannot be known, and they are rarely in its prose."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("#"):
            if line.strip():
                break  # the header ends at the first key
            continue
        lines[i] = re.sub(rf"\bstage {old}\b", f"stage {new} (tuned; was {old})", line)
    return "".join(lines)


def scalar(value: Any) -> str:
    """A value as YAML writes it on one line (strings quoted only when they must be)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else json.dumps(value)
    if isinstance(value, (int,)):
        return str(value)
    if value is None:
        return "null"
    text = str(value)
    return text if _PLAIN.match(text) and text.lower() not in _RESERVED else json.dumps(text)


def _set_key(text: str, parts: list[str], value: Any, comment: str) -> str:
    root = yaml.compose(text, Loader=yaml.SafeLoader) if text.strip() else None
    if root is None:
        return text + _block(parts, value, comment, 0)
    if not isinstance(root, yaml.MappingNode):
        raise ValueError("a recipe is a mapping of keys")
    node: yaml.Node = root
    depth = 0
    while depth < len(parts):
        child = _child(node, parts[depth])
        if child is None:
            if not isinstance(node, yaml.MappingNode):
                raise ValueError(f"{'.'.join(parts[:depth])} is not a section of keys")
            return _insert(text, node, parts[depth:], value, comment)
        if isinstance(child, yaml.ScalarNode) and depth < len(parts) - 1:
            return _expand_shorthand(text, child, parts, depth, value, comment)
        node, depth = child, depth + 1
    if not isinstance(node, yaml.ScalarNode):
        raise ValueError(f"{'.'.join(parts)} is a section, not a value")
    return _replace(text, node, scalar(value), comment)


def _child(node: yaml.Node, key: str) -> yaml.Node | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    return next((v for k, v in node.value if k.value == key), None)


def _replace(text: str, node: yaml.Node, new: str, comment: str) -> str:
    start, end = node.start_mark.index, node.end_mark.index
    text = text[:start] + new + text[end:]
    return _comment_line(text, node.start_mark.line, comment)


def _comment_line(text: str, line_no: int, comment: str) -> str:
    """Append `# tuned: comment` to line `line_no` (0-based), or `; comment` when it has one already."""
    if not comment:
        return text
    lines = text.split("\n")
    line = lines[line_no].rstrip()
    lines[line_no] = f"{line}; {comment}" if f"# {COMMENT_MARK}" in line else f"{line}  # {COMMENT_MARK} {comment}"
    return "\n".join(lines)


def _expand_shorthand(text: str, node: yaml.ScalarNode, parts: list[str], depth: int, value: Any,
                      comment: str) -> str:
    """`offload_optimizer: cpu` + offload_optimizer.nvme_path -> `{device: cpu, nvme_path: ...}`."""
    section = ".".join(parts[: depth + 1])
    short = config.shorthand_of(section)
    if short is None or depth != len(parts) - 2:
        raise ValueError(f"{section} is a value, not a section")
    key = parts[-1]
    if key == short:
        return _replace(text, node, scalar(value), comment)
    mapping = f"{{{short}: {scalar(node.value)}, {key}: {scalar(value)}}}"
    return _replace(text, node, mapping, comment)


def _insert(text: str, parent: yaml.MappingNode, parts: list[str], value: Any, comment: str) -> str:
    """Add `parts` (a key, or a section path ending in one) under `parent`."""
    if parent.flow_style:
        close = parent.end_mark.index - 1  # the `}`
        assert text[close] == "}", "a flow mapping ends with }"
        inline = _flow(parts, value)
        sep = ", " if parent.value else ""
        text = text[:close] + sep + inline + text[close:]
        return _comment_line(text, parent.end_mark.line, comment)
    indent = parent.value[0][0].start_mark.column if parent.value else 0
    after = _last_line(parent)
    lines = text.split("\n")
    block = _block(parts, value, comment, indent).rstrip("\n").split("\n")
    lines[after + 1:after + 1] = block
    return "\n".join(lines)


def _block(parts: list[str], value: Any, comment: str, indent: int) -> str:
    """`a:\\n  b: value  # comment\\n` at `indent`."""
    out = []
    for i, part in enumerate(parts[:-1]):
        out.append(" " * (indent + 2 * i) + f"{part}:")
    tail = f"  # {COMMENT_MARK} {comment}" if comment else ""
    out.append(" " * (indent + 2 * (len(parts) - 1)) + f"{parts[-1]}: {scalar(value)}{tail}")
    return "\n".join(out) + "\n"


def _flow(parts: list[str], value: Any) -> str:
    inner = f"{parts[-1]}: {scalar(value)}"
    for part in reversed(parts[:-1]):
        inner = f"{part}: {{{inner}}}"
    return inner


def _last_line(node: yaml.Node) -> int:
    """The last line (0-based) holding part of `node`'s content (not the blank or comment lines after it)."""
    if isinstance(node, yaml.MappingNode) and node.value and not node.flow_style:
        return max(_last_line(v) for _, v in node.value)
    if isinstance(node, yaml.SequenceNode) and node.value and not node.flow_style:
        return max(_last_line(v) for v in node.value)
    end = node.end_mark
    return end.line - 1 if end.column == 0 and end.line > node.start_mark.line else end.line
