"""Reading a recipe: YAML (with line numbers and bounds on its size), `--set` overrides, DeepSpeed JSON.

`load(path, overrides)` reads a recipe file, applies `--set key.path=value` overrides, merges a
`deepspeed_config` (`config.ds_config` translates it) under the recipe's own keys, and hands the
plain data to `config.convert.from_dict`, recording for each dotted key where it was given so
every message can name a file and line (or the `--set`).
"""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from zerorun.config import ds_config
from zerorun.config.convert import from_dict, where
from zerorun.config.schema import Recipe, dataclass_at
from zerorun.errors import ConfigError

RECIPE_ENV = "ZERORUN_RECIPE"  # the launcher passes the resolved recipe to workers as JSON
RECIPE_FILE_ENV = "ZERORUN_RECIPE_FILE"  # ... which the node supervisor puts in a file of the job's (see launch.node)
MAX_RECIPE_BYTES = 1 << 20  # a recipe is a few hundred keys: a larger file is a mistake, and every rank reads it
MAX_YAML_NODES = 100_000  # YAML values after alias expansion (`*name` repeats what `&name` holds)


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = (), check_script: bool = True) -> Recipe:
    """Read, override and validate a recipe file; `script` and `hostfile` become absolute paths."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the recipe ({exc.strerror or exc}).") from None
    _check_size(len(raw), str(path))
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file ({exc.reason} at byte {exc.start}).") from None
    data, lines = _parse_yaml(text, str(path))
    _apply_overrides(data, lines, overrides)
    translation = _read_deepspeed_config(data, lines, path.resolve().parent, str(path))
    recipe = from_dict(data, str(path), lines)
    _report_autos(recipe, translation)
    recipe.source = str(path.resolve())
    if recipe.name is None:
        recipe.name = path.stem
    base = path.resolve().parent
    recipe.script = str(base / recipe.script)
    if check_script and not Path(recipe.script).is_file():
        raise ConfigError(f"{where(str(path), lines, 'script')}: script: {recipe.script} does not exist "
                          "(paths are relative to the recipe file).")
    if recipe.hostfile is not None:
        recipe.hostfile = str(base / recipe.hostfile)
    return recipe


def loads(text: str, source: str = "<recipe>", overrides: typing.Sequence[str] = ()) -> Recipe:
    """Validate a recipe given as YAML text (paths stay as written)."""
    _check_size(len(text.encode()), source)
    data, lines = _parse_yaml(text, source)
    _apply_overrides(data, lines, overrides)
    translation = _read_deepspeed_config(data, lines, Path.cwd(), source)
    recipe = from_dict(data, source, lines)
    _report_autos(recipe, translation)
    recipe.source = source
    return recipe


def from_env() -> Recipe | None:
    """The recipe the launcher injected into this worker, or None outside a zerorun launch."""
    blob = os.environ.get(RECIPE_ENV)
    if os.environ.get(RECIPE_FILE_ENV):  # what a node supervisor hands its workers (see launch.node)
        with open(os.environ[RECIPE_FILE_ENV]) as file:
            blob = file.read()
    if not blob:
        return None
    recipe = from_dict(json.loads(blob), f"${RECIPE_ENV}")
    recipe.source = os.environ.get(RECIPE_ENV + "_SOURCE")
    return recipe


def _read_deepspeed_config(data: Any, lines: dict[str, int | str], base: Path,
                           source: str) -> ds_config.Translation | None:
    """`deepspeed_config: ds.json`: the DeepSpeed config, translated, under the recipe's own keys
    (which win, `--set` included); messages about its keys name the JSON file and the DeepSpeed key.
    Returns the translation (None: no DeepSpeed config)."""
    if not isinstance(data, dict) or data.get("deepspeed_config") in (None, ""):
        return None
    ds_path = base / str(data["deepspeed_config"])
    if not ds_path.is_file():
        raise ConfigError(f"{where(source, lines, 'deepspeed_config')}: deepspeed_config: {ds_path} does not "
                          "exist (paths are relative to the recipe file).")
    translation = ds_config.read(ds_path)
    ds_config.report(translation, str(ds_path))
    _merge_under(data, translation.data, "")
    for key, origin in translation.origins.items():
        lines.setdefault(key, f"{ds_path}: {origin}")
    data["deepspeed_config"] = str(ds_path)
    return translation


def _report_autos(recipe: Recipe, translation: ds_config.Translation | None) -> None:
    """One line on the DeepSpeed config's "auto" keys: the script fills them (it uses the DeepSpeed API),
    or zerorun's values apply, named with their values."""
    if translation is None or not translation.autos or recipe.deepspeed_config is None:
        return
    targets = {t for target in translation.autos.values() for t in target.split(", ") if t}
    ds_config.report_auto(translation, recipe.deepspeed_config, recipe.launch.deepspeed_compat,
                          {t: value_at(recipe, t) for t in targets})


def value_at(recipe: Recipe, dotted: str) -> Any:
    """The recipe's value at a dotted key (`optimizer.lr`)."""
    node: Any = recipe
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _merge_under(data: dict[str, Any], base: dict[str, Any], prefix: str) -> None:
    """Fill `data` with `base`'s keys where `data` has none (a shorthand scalar is expanded first)."""
    for key, value in base.items():
        if key not in data or data[key] is None:
            data[key] = value
        elif isinstance(value, dict):
            if not isinstance(data[key], dict):
                data[key] = _expand_shorthand(prefix + key, data[key]) or data[key]
            if isinstance(data[key], dict):
                _merge_under(data[key], value, f"{prefix}{key}.")


def _check_size(size: int, source: str) -> None:
    if size > MAX_RECIPE_BYTES:
        raise ConfigError(f"{source}: the recipe is over {MAX_RECIPE_BYTES >> 20} MiB; a recipe holds settings, "
                          "not data: keep large inputs in files the script reads, and name them in `args`.")


def _parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[str, int | str]]:
    """Parse YAML into plain data plus a dotted-key -> line table (for messages).

    Safe YAML only (a `!!python/...` tag is refused with its line), at most `MAX_YAML_NODES` values
    once aliases are expanded (a 1 KB "billion laughs" would otherwise take gigabytes), no alias
    inside itself."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{_yaml_where(exc, source)}: not valid YAML: {_yaml_problem(exc)}.") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply.") from None
    if root is None:
        return {}, {}
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{source}:{root.start_mark.line + 1}: a recipe is a mapping of keys (like `script: train.py`).")
    _check_expansion(root, source)
    lines: dict[str, int | str] = {}
    _record_lines(root, "", lines, source)
    try:
        data = yaml.SafeLoader(text).get_single_data()
    except yaml.YAMLError as exc:  # a tag safe YAML has no constructor for: `!!python/object:...`
        raise ConfigError(f"{_yaml_where(exc, source)}: not allowed in a recipe: {_yaml_problem(exc)} (a recipe "
                          "is plain YAML: mappings, lists, strings, numbers, booleans).") from None
    return data, lines


def _yaml_where(exc: yaml.YAMLError, source: str) -> str:
    mark = getattr(exc, "problem_mark", None)
    return f"{source}:{mark.line + 1}" if mark else source


def _yaml_problem(exc: yaml.YAMLError) -> str:
    return str(getattr(exc, "problem", None) or exc).split(" in \"")[0]


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse a document whose aliases expand past `MAX_YAML_NODES` values, or contain themselves."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in open_nodes:
            raise ConfigError(f"{source}:{node.start_mark.line + 1}: an alias refers to the value that holds it "
                              "(a recursive &anchor); write the value out.")
        if id(node) not in sizes:
            open_nodes.add(id(node))
            children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
                node.value if isinstance(node, yaml.SequenceNode) else []
            sizes[id(node)] = min(MAX_YAML_NODES + 1, 1 + sum(size(child) for child in children))
            open_nodes.discard(id(node))
        return sizes[id(node)]

    try:
        if size(root) <= MAX_YAML_NODES:
            return
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply.") from None
    node = root  # name the innermost value that is too large by itself: the top of the alias chain
    while True:
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        big = [child for child in children if sizes.get(id(child), 0) > MAX_YAML_NODES]
        if not big:
            break
        node = big[0]
    raise ConfigError(f"{source}:{node.start_mark.line + 1}: this value expands to more than {MAX_YAML_NODES:,} "
                      "YAML values through its aliases (*name repeats what &name holds); a recipe needs no such "
                      "expansion: write the values out.")


def _record_lines(node: yaml.Node, prefix: str, lines: dict[str, int | str], source: str) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = f"{prefix}{key_node.value}"
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"{source}:{line}: {key}: given twice (first at line {lines[key]}).")
        seen.add(key)
        lines[key] = line
        _record_lines(value_node, key + ".", lines, source)


def _apply_overrides(data: dict[str, Any], lines: dict[str, int | str], overrides: typing.Sequence[str]) -> None:
    """Apply `key.path=value` strings; the value is read as YAML (`3`, `1e-4`, `true`, `[a, b]`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set zero.stage=3.")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if not isinstance(child, dict):
                # A shorthand scalar (`precision: bf16`) becomes its mapping before a subkey is set.
                child = _expand_shorthand(".".join(parts[: depth + 1]), child)
                node[part] = child
            node = child
        node[parts[-1]] = value
        for stale in [k for k in lines if k == key or k.startswith(key + ".")]:
            del lines[stale]
        lines[key] = f"--set {item}"


def _expand_shorthand(dotted: str, value: Any) -> dict[str, Any]:
    cls = dataclass_at(dotted)
    short = getattr(cls, "__shorthand__", None) if cls else None
    if value is None or cls is None:
        return {}
    if short is not None and not isinstance(value, (dict, list)):
        return {short: value}
    return {}
