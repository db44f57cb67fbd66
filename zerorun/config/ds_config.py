"""A DeepSpeed config (`ds_config.json`) as recipe data: pure, and every key accounted for.

    t = translate(json.load(open("ds_config.json")), world_size=8)
    t.data       # {"zero": {"stage": 2, ...}, "precision": {...}, "train": {...}, ...}: recipe data
    t.origins    # recipe key -> the DeepSpeed key it came from (for messages and comments)
    t.notes      # one per key zerorun does not map: INFO (does the same anyway), WARNING, ERROR
    t.autos      # DeepSpeed key -> the recipe key(s) it stands for, for every "auto" value

Every key of the input meets exactly one rule of `ds_keys.RULES` or one section handler below (the
batch triple, fp16/bf16, the optimizer's type, the scheduler's type, the old offload spellings);
a key no rule knows is a WARNING, or an ERROR when it looks like a typo of a known key. Keys that
DeepSpeed defaults differently from zerorun are always written out (ZeRO stage 0, weight decay 0,
hysteresis 2), so a translated recipe trains as DeepSpeed would. `"auto"` is a placeholder that
transformers and accelerate fill in from the script's own arguments before `deepspeed.initialize`:
read from the file, it leaves zerorun's default and is listed in `autos`; `auto_line` says in one line
what applies to them (the script's values, or zerorun's where nothing will fill them).

This module imports nothing of zerorun's but `errors` and `ds_keys`: `config.load` uses it to read
a recipe's `deepspeed_config`, and it must not depend on the rest of the package or above it.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zerorun.config.ds_keys import COMPRESSED_OPTIMIZERS, DS_OPTIMIZERS, RULES, Level, Rule, rule_for
from zerorun.errors import ConfigError

SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
DS_NAMES = ("Adam", "AdamW", "Lamb", "Lion", "Adagrad", "Muon", "SGD", "RMSprop", "Adafactor")
AUTO = "auto"


@dataclass(frozen=True)
class Note:
    """What happened to one DeepSpeed key that did not simply map."""

    key: str
    level: Level
    message: str

    def render(self, source: str) -> str:
        return f"{source}: {self.key}: {self.message}"


@dataclass(frozen=True)
class Batch:
    """DeepSpeed's batch triple as the config gives it (None: absent or "auto")."""

    train_batch_size: int | None
    micro: int | None
    accum: int | None

    @property
    def needs_world(self) -> bool:
        """Whether the world size is needed to know the micro-batch and the accumulation (with all three
        given it is not: the recipe keeps train_batch_size as train.global_batch_size, checked at launch)."""
        return self.train_batch_size is not None and (self.micro is None or self.accum is None)

    def resolve(self, world: int) -> tuple[int, int, int]:
        """(micro, accum, train_batch_size) by DeepSpeed's rule: two of them give the third, and all
        three must satisfy train_batch_size = micro x accum x world (ValueError says which broke it)."""
        tb, micro, accum = self.train_batch_size, self.micro, self.accum
        if tb is not None and micro is not None and accum is None:
            accum = tb // micro // world
        elif tb is not None and micro is None:
            accum = accum or 1
            micro = tb // world // accum
        elif micro is not None:
            accum = accum or 1
            tb = micro * accum * world if tb is None else tb
        else:
            raise ValueError("give train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed needs one)")
        if min(micro, accum) < 1 or tb != micro * accum * world:
            raise ValueError(f"train_batch_size {tb} != train_micro_batch_size_per_gpu {micro} x "
                             f"gradient_accumulation_steps {accum} x world size {world}; DeepSpeed's rule is "
                             "train_batch_size = micro-batch x accumulation x world size")
        return micro, accum, tb


@dataclass
class Translation:
    data: dict[str, Any] = field(default_factory=dict)  # nested recipe data
    origins: dict[str, str] = field(default_factory=dict)  # recipe dotted key -> DeepSpeed key
    notes: list[Note] = field(default_factory=list)
    batch: Batch = Batch(None, None, None)
    autos: dict[str, str] = field(default_factory=dict)  # DeepSpeed key of an "auto" -> the recipe key(s) it sets

    def set(self, target: str, value: Any, origin: str) -> None:
        node = self.data
        *parents, leaf = target.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        self.origins[target] = origin

    def note(self, key: str, level: Level, message: str) -> None:
        self.notes.append(Note(key, level, message))

    @property
    def errors(self) -> list[Note]:
        return [n for n in self.notes if n.level is Level.ERROR]

    @property
    def warnings(self) -> list[Note]:
        return [n for n in self.notes if n.level is Level.WARNING]


def read(path: str | os.PathLike, world_size: int | None = None) -> Translation:
    """Read and translate a DeepSpeed JSON file; a ConfigError names the file and every refused key."""
    translation = translate(load_json(path), world_size)
    check(translation, str(path))
    return translation


def load_json(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path) as file:
            ds = json.load(file)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the DeepSpeed config ({exc.strerror or exc}).") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}.") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object of keys.")
    return ds


def check(translation: Translation, source: str) -> None:
    """Raise one ConfigError listing every refused key."""
    errors = translation.errors
    if errors:
        lines = "\n  ".join(n.render(source) for n in errors)
        raise ConfigError(f"{source}: {len(errors)} DeepSpeed key(s) zerorun cannot honour:\n  {lines}")


_shown_lines: set[str] = set()


def report(translation: Translation, source: str, file: Any = None) -> None:
    """Print each warning once per process (a config read twice warns once)."""
    for note in translation.warnings:
        print_once(f"zerorun: warning: {note.render(source)}", file)


def auto_line(translation: Translation, source: str, filled_by_script: bool,
              values: Mapping[str, Any] | None = None) -> str | None:
    """One line about the config's "auto" values, or None when it has none.

    `filled_by_script`: the script uses the DeepSpeed API (`launch.deepspeed_compat`), so transformers or
    accelerate fill them in from its own arguments before `deepspeed.initialize`, and zerorun trains with
    what they become (it prints them then, and refuses any still "auto", as DeepSpeed does): an information,
    not a warning. Otherwise nothing will fill them: a warning giving zerorun's values that apply (`values`:
    recipe key -> value)."""
    autos = translation.autos
    if not autos:
        return None
    keys = ", ".join(autos)
    if filled_by_script:
        return (f"zerorun: {source}: \"auto\" in {_count(len(autos), 'key')} ({keys}): the script fills them in "
                "(transformers and accelerate do, from its own arguments) when it calls deepspeed.initialize; "
                "zerorun trains with those values and prints them then (one still \"auto\" there is refused).")
    return (f"zerorun: warning: {source}: \"auto\" in {_count(len(autos), 'key')} and nothing to fill them in "
            "(transformers and accelerate fill them when the script calls deepspeed.initialize, with "
            f"launch.deepspeed_compat on): zerorun's values apply: {applied_values(autos, values)}.")


def applied_values(autos: Mapping[str, str], values: Mapping[str, Any] | None) -> str:
    """`optimizer.params.lr -> optimizer.lr 0.001; ...`: what zerorun applies for each "auto" key."""
    shown = []
    for key, target in autos.items():
        applied = [f"{t} {shown_value(values[t])}" for t in target.split(", ") if values is not None and t in values]
        shown.append(f"{key} -> {', '.join(applied)}" if applied else key)
    return "; ".join(shown)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def shown_value(value: Any) -> str:
    """A value as JSON would say it where Python's str() would not (lists, booleans, null)."""
    return json.dumps(value) if isinstance(value, (list, bool)) or value is None else str(value)


def print_once(line: str, file: Any = None) -> None:
    """Print a line once per process (a config read twice says it once)."""
    if line not in _shown_lines:
        _shown_lines.add(line)
        print(line, file=file or sys.stderr)


def report_auto(translation: Translation, source: str, filled_by_script: bool,
                values: Mapping[str, Any] | None = None, file: Any = None) -> None:
    """Print `auto_line` once per process."""
    line = auto_line(translation, source, filled_by_script, values)
    if line is not None:
        print_once(line, file)


def translate(ds: Mapping[str, Any], world_size: int | None = None) -> Translation:
    """Recipe data for a DeepSpeed config (a dict as json.load gives it)."""
    t = Translation()
    for key, value in _leaves(ds):
        _apply(t, key, value)
    _batch(t, ds, world_size)
    _precision(t, ds)
    _optimizer(t, ds)
    _scheduler(t, ds)
    _zero(t, ds)
    return t


def _leaves(node: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every key, stopping at section rules and non-mapping values."""
    out = []
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        found = rule_for(dotted)
        if isinstance(value, Mapping) and not value and found is None:
            continue  # an empty section ("params": {}) says nothing
        if isinstance(value, Mapping) and value and not (found and found[1].section and found[0] == dotted):
            out.extend(_leaves(value, dotted + "."))
        else:
            out.append((dotted, value))
    return out


def _apply(t: Translation, key: str, value: Any) -> None:
    """One key through its rule: mapped, or a note saying what zerorun does instead."""
    found = rule_for(key)
    if found is None:
        _unknown(t, key)
        return
    _, rule = found
    if rule.handled:
        return
    if isinstance(value, str) and value == AUTO:
        t.autos[key] = rule.target or ""  # no target: a key zerorun has no use for, whatever fills it
        return
    if rule.target:
        try:
            t.set(rule.target, rule.convert(value) if rule.convert else value, key)
        except (TypeError, ValueError) as exc:
            t.note(key, Level.ERROR, f"{exc} ({rule.why}).")
        return
    if _harmless(rule, value):
        t.note(key, Level.INFO, f"{rule.why}.")
        return
    prefix = {Level.INFO: "", Level.WARNING: "ignored: ", Level.ERROR: "not supported: "}[rule.level]
    t.note(key, rule.level, f"{prefix}{rule.why}.")


def _harmless(rule: Rule, value: Any) -> bool:
    if isinstance(value, Mapping) and rule.section:
        return value.get("enabled") is False or not value
    return any(value == h and type(value) is type(h) for h in rule.harmless) if rule.harmless else False


def _unknown(t: Translation, key: str) -> None:
    close = difflib.get_close_matches(key, list(RULES), n=1, cutoff=0.85)
    if close:
        t.note(key, Level.ERROR, f"not a DeepSpeed key; did you mean {close[0]}? (DeepSpeed would ignore it "
                                 "silently; zerorun refuses a likely typo)")
    else:
        t.note(key, Level.WARNING, "not a DeepSpeed key zerorun knows; ignored.")


def _get(ds: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = ds
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _int_or_none(t: Translation, ds: Mapping[str, Any], key: str) -> int | None:
    value = _get(ds, key)
    if value is None or value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        t.note(key, Level.ERROR, f"expected a positive integer, got {value!r}.")
        return None
    return int(value)


def _batch(t: Translation, ds: Mapping[str, Any], world: int | None) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    t.batch = batch = Batch(*(_int_or_none(t, ds, k) for k in keys))
    targets = ("train.global_batch_size", "train.micro_batch_size", "train.grad_accum_steps")
    t.autos.update({key: target for key, target in zip(keys, targets) if _get(ds, key) == AUTO})
    if batch.train_batch_size is None and batch.micro is None:
        if any(_get(ds, k) == AUTO for k in keys):
            return  # the recipe's train.micro_batch_size and train.grad_accum_steps apply (or what fills them)
        t.note("train_batch_size", Level.ERROR, "give train_batch_size or train_micro_batch_size_per_gpu "
                                                "(DeepSpeed needs one of them).")
        return
    if world is not None:
        try:
            micro, accum, tb = batch.resolve(world)
        except ValueError as exc:
            t.note("train_batch_size", Level.ERROR, f"{exc}.")
            return
        t.set("train.micro_batch_size", micro, "train_micro_batch_size_per_gpu")
        t.set("train.grad_accum_steps", accum, "gradient_accumulation_steps")
        t.set("train.global_batch_size", tb, "train_batch_size")
        return
    # the world size is known at launch: what the config gives now, the rest filled in there
    for target, origin, value in (("train.micro_batch_size", keys[1], batch.micro),
                                  ("train.grad_accum_steps", keys[2], batch.accum),
                                  ("train.global_batch_size", keys[0], batch.train_batch_size)):
        if value is not None:
            t.set(target, value, origin)
    if batch.micro is not None and batch.train_batch_size is None:
        t.set("train.grad_accum_steps", batch.accum or 1, keys[2])


def _enabled(t: Translation, ds: Mapping[str, Any], section: str) -> bool:
    value = _get(ds, f"{section}.enabled", False)
    if value == AUTO:
        t.autos[f"{section}.enabled"] = "precision.dtype"  # taken as false until it is filled in
        return False
    if not isinstance(value, bool):
        t.note(f"{section}.enabled", Level.ERROR, f"expected true or false, got {value!r}.")
        return False
    return value


def _precision(t: Translation, ds: Mapping[str, Any]) -> None:
    fp16 = _enabled(t, ds, "fp16")
    bf16 = _enabled(t, ds, "bf16") or _enabled(t, ds, "bfloat16")
    if fp16 and bf16:
        t.note("fp16.enabled", Level.ERROR, "fp16 and bf16 are both enabled; enable one.")
        return
    t.set("precision.dtype", "fp16" if fp16 else "bf16" if bf16 else "fp32",
          "fp16.enabled" if fp16 else "bf16.enabled")
    if not fp16:
        return
    t.set("precision.hysteresis", int(_get(ds, "fp16.hysteresis", 2)), "fp16.hysteresis")  # DeepSpeed's default: 2
    static = _get(ds, "fp16.loss_scale", 0)
    if isinstance(static, (int, float)) and not isinstance(static, bool) and static > 0:
        t.set("precision.initial_loss_scale", float(static), "fp16.loss_scale")
        t.set("precision.dynamic_loss_scale", False, "fp16.loss_scale")
        return
    power = _get(ds, "fp16.initial_scale_power", 16)
    if isinstance(power, bool) or not isinstance(power, int):
        t.note("fp16.initial_scale_power", Level.ERROR, f"expected an integer power of 2, got {power!r}.")
        return
    t.set("precision.initial_loss_scale", float(2**power), "fp16.initial_scale_power")


def _optimizer(t: Translation, ds: Mapping[str, Any]) -> None:
    kind = _get(ds, "optimizer.type")
    if kind is None:
        return
    name = str(kind).lower()
    if name in COMPRESSED_OPTIMIZERS:
        t.note("optimizer.type", Level.ERROR, f"{kind}: a 1-bit optimizer compresses its own communication; zerorun "
                                              "compresses gradients with zero.quantized_gradients (qgZ): use Adam or "
                                              "Lamb with it.")
        return
    if name not in DS_OPTIMIZERS:
        t.note("optimizer.type", Level.ERROR, f"{kind}: a config builds {', '.join(sorted(DS_NAMES))}; pass any other "
                                              "torch optimizer to deepspeed.initialize(optimizer=...) instead "
                                              "(docs/optimizers.md).")
        return
    recipe_type = DS_OPTIMIZERS[name]
    if name == "adam" and _get(ds, "optimizer.params.adam_w_mode", True) is False:
        recipe_type = "adam"  # DeepSpeed: type Adam means AdamW (decoupled decay) unless adam_w_mode is false
    t.set("optimizer.type", recipe_type, "optimizer.type")
    if _get(ds, "optimizer.params.weight_decay") is None:
        t.set("optimizer.weight_decay", 0.0, "optimizer.params.weight_decay")  # DeepSpeed's optimizers' default
    for key, default in (("lr", 1e-3), ("betas", [0.9, 0.999]), ("eps", 1e-8)):
        if recipe_type in ("adam", "adamw", "lamb") and _get(ds, f"optimizer.params.{key}") is None:
            t.set(f"optimizer.{key}", default, f"optimizer.params.{key}")
    if recipe_type == "muon":  # muon_lr is Muon's lr, adam_lr its AdamW's; lr both where they are not given
        lr = _get(ds, "optimizer.params.lr")
        if _get(ds, "optimizer.params.muon_lr") is not None:
            t.set("optimizer.lr", float(_get(ds, "optimizer.params.muon_lr")), "optimizer.params.muon_lr")
            if lr is not None and _get(ds, "optimizer.params.adam_lr") is None:
                t.set("optimizer.adam_lr", float(lr), "optimizer.params.lr")


def _scheduler(t: Translation, ds: Mapping[str, Any]) -> None:
    kind = _get(ds, "scheduler.type")
    if kind is None:
        return
    if kind not in SCHEDULERS:
        t.note("scheduler.type", Level.ERROR, f"{kind}: zerorun has DeepSpeed's {', '.join(SCHEDULERS)}; "
                                              "or pass lr_scheduler= to initialize.")
        return
    t.set("scheduler.type", kind, "scheduler.type")
    for key, value in (_get(ds, "scheduler.params") or {}).items():
        if isinstance(value, (list, tuple)):
            t.note(f"scheduler.params.{key}", Level.ERROR, "a value per param group is not supported; give one "
                                                            "number for every group.")


def _zero(t: Translation, ds: Mapping[str, Any]) -> None:
    zero = _get(ds, "zero_optimization") or {}
    if "stage" not in zero:
        t.set("zero.stage", 0, "zero_optimization.stage")  # DeepSpeed's default: no ZeRO
    if zero.get("cpu_offload") is True:
        t.set("zero.offload_optimizer.device", "cpu", "zero_optimization.cpu_offload")
    if zero.get("cpu_offload_param") is True:
        t.set("zero.offload_param.device", "cpu", "zero_optimization.cpu_offload_param")
    if "cpu_offload_use_pin_memory" in zero:
        for kind in ("offload_optimizer", "offload_param"):
            t.set(f"zero.{kind}.pin_memory", bool(zero["cpu_offload_use_pin_memory"]),
                  "zero_optimization.cpu_offload_use_pin_memory")
