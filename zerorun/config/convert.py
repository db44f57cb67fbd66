"""Plain data -> a validated Recipe: the generic converter, and the rules that span several keys.

`from_dict` walks the schema's dataclasses (`config.schema`) with the value's type hints: a Literal is
a choice, a number is checked against its field's bounds, a section may be a shorthand scalar. Every
problem is one `ConfigError` naming where the key was given (`file:line`, or the `--set`), the dotted
key and what was expected; the YAML and `--set` reading that records those places is `config.load`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import shlex
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from zerorun.config.counts import parse_count
from zerorun.config.schema import OPTIMIZER_KEYS, OffloadConfig, Recipe, literal_text, range_text
from zerorun.errors import ConfigError

GIVEN_KEY = "_given"  # in `to_json`: the keys the user set (`Recipe.given`), so a worker can name them
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell (and `env K=V`) accepts as a variable name


def from_dict(data: Any, source: str = "<recipe>", lines: dict[str, int | str] | None = None) -> Recipe:
    """Build and validate a Recipe from plain data (parsed YAML or `to_dict` output)."""
    ctx = _Ctx(source, lines or {})
    if data is None:
        data = {}
    if isinstance(data, dict) and "script" not in data:
        raise ConfigError(f"{source}: script: missing; every recipe names its training script, e.g. `script: train.py`.")
    given = data.pop(GIVEN_KEY, None) if isinstance(data, dict) else None
    recipe: Recipe = _build(Recipe, data, "", ctx)
    _check_cross_fields(recipe, ctx)
    recipe.given = dict(given) if isinstance(given, dict) else {k: where(source, ctx.lines, k) for k in ctx.lines}
    return recipe


def to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data, round-trippable through `from_dict` (used to hand the recipe to workers)."""
    data = dataclasses.asdict(recipe)
    data.pop("source")
    data.pop("given")
    return data


def to_json(recipe: Recipe) -> str:
    """The recipe for a worker: `to_dict` plus which keys the user gave, and where (`Recipe.given`)."""
    return json.dumps({**to_dict(recipe), GIVEN_KEY: recipe.given}, sort_keys=True)


def given_in(recipe: Recipe, section: str) -> dict[str, str]:
    """The keys of `section` (e.g. "optimizer") the user set, each with where: file:line or the `--set`."""
    return {k: where for k, where in recipe.given.items() if k == section or k.startswith(section + ".")}


def known_steps(recipe: Recipe) -> int | None:
    """The optimizer steps a zerorun script is known to run: `train.steps` where the user gave it (the recipe or a
    `--set`). Its default says nothing of a script that counts its own loop (`for it in range(max_iters)`), and a
    progress of "7/100 ... ETA" built on it reads as a job that will stop at 100: no total then."""
    return recipe.train.steps if "train.steps" in recipe.given else None


def check_global_batch(recipe: Recipe, world_size: int) -> None:
    """`train.global_batch_size` against the world size the job runs on: a ConfigError when they disagree."""
    train = recipe.train
    if train.global_batch_size is None:
        return
    actual = train.micro_batch_size * train.grad_accum_steps * world_size
    if actual != train.global_batch_size:
        origin = f" (from {recipe.deepspeed_config}: train_batch_size)" if recipe.deepspeed_config else ""
        raise ConfigError(f"{recipe.source or 'the recipe'}: train.global_batch_size: {train.global_batch_size}"
                          f"{origin} != micro_batch_size {train.micro_batch_size} x grad_accum_steps "
                          f"{train.grad_accum_steps} x world size {world_size} = {actual}; change one of them "
                          "(or the number of workers).")


@dataclass
class _Ctx:
    source: str
    lines: dict[str, int | str]  # dotted key -> line in the file, or the `--set ...` that gave it


def where(source: str, lines: dict[str, int | str], key: str) -> str:
    """`file:line` for a dotted key (or its nearest parent), or the `--set` that gave it."""
    probe = key.split("[")[0]
    while probe:
        line = lines.get(probe)
        if isinstance(line, str):
            return line
        if line:
            return f"{source}:{line}"
        probe = probe.rpartition(".")[0]
    return source


def _fail(ctx: _Ctx, key: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{where(ctx.source, ctx.lines, key)}: {key}: {message}")


def _build(cls: type, data: Any, prefix: str, ctx: _Ctx) -> Any:
    short = getattr(cls, "__shorthand__", None)
    if short is not None and data is not None and not isinstance(data, (dict, list)):
        data = {short: data}
    if not isinstance(data, dict):
        _fail(ctx, prefix.rstrip(".") or "(top level)",
              f"expected a mapping of keys, got {_describe(data)}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    for key in data:
        if key not in fields:
            _fail(ctx, f"{prefix}{key}", f"unknown key{_suggest(str(key), fields)}")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _convert(hints[name], data[name], f"{prefix}{name}", f.metadata, ctx)
    return cls(**values)


def _suggest(key: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(choices), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f"; valid keys here: {', '.join(sorted(choices))}."


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    return f"{type(value).__name__} {value!r}"


def _convert(tp: Any, value: Any, key: str, meta: typing.Mapping[str, Any], ctx: _Ctx) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 2:  # a word beside a number (`prefetch_units: auto | int`)
            word, number = sorted(inner, key=lambda a: typing.get_origin(a) is not Literal)
            if isinstance(value, str) and not value.strip()[:1].isdigit():
                if value in typing.get_args(word):
                    return value
                choices = [*map(literal_text, typing.get_args(word)), "an integer" if number is int else "a number"]
                close = difflib.get_close_matches(value, choices[:-1], n=1)
                _fail(ctx, key, f"expected {' or '.join(choices)}, got {_describe(value)}"
                      f"{f'; did you mean {close[0]!r}?' if close else '.'}")
            return _convert(number, value, key, meta, ctx)
        (single,) = inner
        return _convert(single, value, key, meta, ctx)
    if dataclasses.is_dataclass(tp):
        return _build(typing.cast(type, tp), value, key + ".", ctx)
    if origin is Literal:
        if (type(value), value) not in {(type(a), a) for a in args}:  # 1 is not true, nor "1" 1
            close = difflib.get_close_matches(str(value), [literal_text(a) for a in args], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            _fail(ctx, key, f"expected one of {', '.join(map(literal_text, args))}, got {_describe(value)}{hint or '.'}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(ctx, key, f"expected true or false, got {_describe(value)}.")
        return value
    if tp in (int, float):
        return _check_bounds(_number(tp, value, key, ctx), key, meta, ctx)
    if tp is str:
        if isinstance(value, (dict, list)) or value is None:
            _fail(ctx, key, f"expected a string, got {_describe(value)}.")
        return str(value)
    if origin is list:
        return _convert_list(args[0], value, key, meta, ctx)
    if origin is dict:
        if not isinstance(value, dict):
            _fail(ctx, key, f"expected a mapping of NAME: value, got {_describe(value)}.")
        for k, v in value.items():
            if isinstance(v, (dict, list)) or v is None:
                _fail(ctx, f"{key}.{k}", f"expected a plain value, got {_describe(v)}.")
        return {str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items()}
    raise AssertionError(f"config: no converter for {tp!r} at {key}")


def _number(tp: type, value: Any, key: str, ctx: _Ctx) -> int | float:
    # PyYAML reads `1e5` and `3e-4` (no dot) as strings; users mean numbers. An integer key is a count,
    # which may be written as one (`steps: 10K`, `param_persistence_threshold: 1e5`: `counts`).
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            if tp is int and value.strip()[:1].isdigit():  # `10K`; `two` is no count, just not an integer
                try:
                    return parse_count(value)
                except ValueError as exc:
                    _fail(ctx, key, f"expected an integer: {exc}.")
            _fail(ctx, key, f"expected {'an integer' if tp is int else 'a number'}, got {_describe(value)}.")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(ctx, key, f"expected {'an integer' if tp is int else 'a number'}, got {_describe(value)}.")
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            _fail(ctx, key, f"expected an integer, got {value!r}.")
        return int(value)
    return float(value)


def _check_bounds(value: float, key: str, meta: typing.Mapping[str, Any], ctx: _Ctx) -> float:
    tests = [("ge", value >= meta.get("ge", value), ">="), ("gt", "gt" not in meta or value > meta["gt"], ">"),
             ("le", value <= meta.get("le", value), "<="), ("lt", "lt" not in meta or value < meta["lt"], "<")]
    for name, ok, sign in tests:
        if not ok:
            _fail(ctx, key, f"must be {range_text(meta)}, got {value!r}.")
    return value


def _convert_list(item_tp: Any, value: Any, key: str, meta: typing.Mapping[str, Any], ctx: _Ctx) -> list[Any]:
    if item_tp is str and isinstance(value, str):
        return shlex.split(value)
    if not isinstance(value, list):
        _fail(ctx, key, f"expected a list, got {_describe(value)}.")
    out = []
    for i, item in enumerate(value):
        if item_tp is str:
            if isinstance(item, (dict, list)) or item is None:
                _fail(ctx, f"{key}[{i}]", f"expected a string, got {_describe(item)}.")
            out.append(str(item))
        else:
            out.append(_convert(item_tp, item, f"{key}[{i}]", meta, ctx))
    return out


def _check_cross_fields(recipe: Recipe, ctx: _Ctx) -> None:
    """Rules that involve more than one key."""
    if not recipe.script:
        _fail(ctx, "script", "must name the training script.")
    betas = recipe.optimizer.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        _fail(ctx, "optimizer.betas", f"expected two numbers in [0, 1), got {betas!r}.")
    chosen = recipe.optimizer.type
    for key in ctx.lines:
        if key.startswith("optimizer.") and key != "optimizer.type" and \
                key.removeprefix("optimizer.") not in OPTIMIZER_KEYS[chosen]:
            _fail(ctx, key, f"optimizer.type {chosen} does not use it (it reads {', '.join(OPTIMIZER_KEYS[chosen])}); "
                            "remove it, or choose a type that does (docs/optimizers.md).")
    for kind in ("offload_optimizer", "offload_param"):
        off: OffloadConfig = getattr(recipe.zero, kind)
        if off.device == "nvme" and not off.nvme_path:
            _fail(ctx, f"zero.{kind}.nvme_path", "required when device is nvme (a directory on a fast local disk).")
    if recipe.zero.offload_param.device != "none" and recipe.zero.stage != 3:
        _fail(ctx, "zero.offload_param.device",
              f"parameter offload needs zero.stage: 3 (stage is {recipe.zero.stage}); "
              "use zero.offload_optimizer for stages 1 and 2.")
    if recipe.zero.offload_param.device != "none" and recipe.zero.offload_optimizer.device == "none":
        _fail(ctx, "zero.offload_param.device",
              "parameter offload needs zero.offload_optimizer too: the fp32 master is the larger copy of the "
              "parameters, so offload it first (e.g. offload_optimizer: cpu).")
    if recipe.zero.quantized_gradients is True and recipe.zero.stage == 0:
        _fail(ctx, "zero.quantized_gradients", "stage 0 all-reduces gradients; quantized gradients apply to the "
              "reduce-scatter of zero.stage 1, 2 or 3. Raise the stage or leave this off.")
    if recipe.zero.hpz_partition_size > 1 and recipe.zero.stage != 3:
        _fail(ctx, "zero.hpz_partition_size", f"the secondary copy is of stage 3's gathered parameters (stage is "
              f"{recipe.zero.stage}). Use zero.stage: 3 or leave it at 1.")
    if recipe.zero.quantized_weights is True and recipe.zero.stage == 0:
        _fail(ctx, "zero.quantized_weights", "stage 0 gathers no weights (every rank updates all of them); "
              "quantized weights apply to the all-gathers of zero.stage 1, 2 or 3. Raise the stage or leave this off.")
    if recipe.zero.offload_optimizer.device != "none" and recipe.zero.stage == 0:
        _fail(ctx, "zero.offload_optimizer.device", "optimizer offload needs zero.stage >= 1.")
    if recipe.zero.offload_optimizer_ratio < 1 and recipe.zero.offload_optimizer.device != "cpu":
        _fail(ctx, "zero.offload_optimizer_ratio", f"{recipe.zero.offload_optimizer_ratio} keeps a share of the "
              f"optimizer state in host memory, and zero.offload_optimizer is {recipe.zero.offload_optimizer.device}. "
              f"Set zero.offload_optimizer: cpu, or leave the ratio at 1.")
    if recipe.zero.overlap_optimizer is True and recipe.zero.offload_optimizer.device != "cpu":
        _fail(ctx, "zero.overlap_optimizer", f"true runs the host optimizer under the backward, and the optimizer "
              f"state is not in host memory (zero.offload_optimizer: {recipe.zero.offload_optimizer.device}). Set "
              f"zero.offload_optimizer: cpu, or overlap_optimizer: auto.")
    for key in ("every_steps", "every_minutes"):
        value = getattr(recipe.checkpoint, key)
        if value and not recipe.checkpoint.dir:
            _fail(ctx, f"checkpoint.{key}", f"{value} saves nothing without checkpoint.dir; "
                  f"set checkpoint.dir (a directory every node can write) or {key}: 0.")
    for key, value in recipe.env.items():
        if not ENV_KEY.fullmatch(key):
            _fail(ctx, f"env.{key}", "is not an environment variable name (letters, digits and '_', not starting "
                  "with a digit); write `env: {NAME: value}`.")
        if "\0" in value:
            _fail(ctx, f"env.{key}", "a value cannot hold a NUL character.")
    if recipe.zero.aio.block_size % 4096:
        _fail(ctx, "zero.aio.block_size", f"must be a multiple of 4096 (O_DIRECT), got {recipe.zero.aio.block_size}.")
