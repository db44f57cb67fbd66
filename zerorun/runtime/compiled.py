"""A model the script compiled with `torch.compile` before `zerorun.initialize`: what zerorun must know of it.

Users compile in two ways, and zerorun's hooks (stage 3's gathers, stages 1/2's publish waits) meet
dynamo differently in each:

| how the script compiled                        | where zerorun's module hooks run                          |
|------------------------------------------------|-----------------------------------------------------------|
| `torch.compile(model)` (an `OptimizedModule`)  | the root's: outside; every other module's: traced         |
| `block.compile()`, `torch.compile(block)` in place | the block's: outside (dynamo compiles its `forward`); its submodules': traced |

A hook that dynamo traces and cannot put in a graph (a collective, a lock, a state change) is a graph
break; `eager_under_compile` marks zerorun's own hook functions so that it is one, run as plain Python,
instead of a crash or a traced side effect (the "is at version 2; expected version 1" of stage 3 under
`torch.compile(model)` was a gather's `param.data = ...` traced into the graph). Nothing of torch's or the
user's is changed: the marks are on zerorun's functions. docs/profiling-and-compiling.md lists the graph
breaks that remain, per stage, and why each must exist.

`inspect` reads, never changes, what the script compiled; `refuse_unworkable` turns the combinations that
cannot work into a `ZerorunError` at `initialize`, before any step: a graph break is an error under
`fullgraph=True`, and stage 3 needs one around every unit that a whole-model compile holds inside.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar, cast

from torch import nn

from zerorun.errors import ZerorunError

F = TypeVar("F", bound=Callable[..., Any])
_DYNAMO = "torch._dynamo"


def dynamo_loaded() -> bool:
    """Whether torch.compile has been used in this process (importing dynamo takes seconds: nothing else does)."""
    return _DYNAMO in sys.modules


def eager_under_compile(fn: F) -> F:
    """`fn`, which torch.compile then runs as plain Python (one graph break) rather than tracing it.

    While dynamo is not loaded nothing can be compiled, and `fn` is returned as it is: marking it would
    import dynamo, seconds on every `initialize` of a script that never compiles.
    """
    if not dynamo_loaded():
        return fn
    import torch

    return cast(F, torch.compiler.disable(fn))


def optimized_module_type() -> type | None:
    """torch's `OptimizedModule` (what `torch.compile(module)` returns), or None while dynamo is not loaded."""
    if not dynamo_loaded():
        return None
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


def unwrapped(module: nn.Module) -> nn.Module:
    """The module a `torch.compile(module)` wrapper holds (the module itself when it is no wrapper)."""
    wrapper = optimized_module_type()
    while wrapper is not None and isinstance(module, wrapper):
        module = cast(nn.Module, module._orig_mod)
    return module


def model_name(name: str) -> str:
    """A module's name as the model names it: without the `_orig_mod.` that compile wrappers insert."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


@dataclass(frozen=True)
class CompiledModel:
    """What the script compiled in a model, by module name ("" is the root)."""

    whole: bool = False  # torch.compile(model): the root is an OptimizedModule
    parts: list[str] = field(default_factory=list)  # modules compiled on their own (module.compile() or a wrapper)
    fullgraph: list[str] = field(default_factory=list)  # of the root and the parts: compiled with fullgraph=True

    @property
    def any(self) -> bool:
        return self.whole or bool(self.parts)


def inspect(model: nn.Module) -> CompiledModel:
    """Where `model` is compiled; a model of a process that never loaded dynamo is not."""
    wrapper = optimized_module_type()
    if wrapper is None:
        return CompiledModel()
    whole = isinstance(model, wrapper)
    parts, fullgraph = [], []
    if whole and _fullgraph(model):
        fullgraph.append("")
    for name, module in model.named_modules():
        if module is model or (whole and module is model._orig_mod):
            continue
        if isinstance(module, wrapper) or getattr(module, "_compiled_call_impl", None) is not None:
            parts.append(name)
            if _fullgraph(module):
                fullgraph.append(name)
    return CompiledModel(whole, parts, fullgraph)


def _fullgraph(module: nn.Module) -> bool:
    """Whether `module` was compiled with fullgraph=True, as far as torch lets it be read (False when not)."""
    context = getattr(module, "dynamo_ctx", None)  # an OptimizedModule's
    if context is None:  # module.compile(): the compiled function closes over the same kind of context
        compiled = getattr(module, "_compiled_call_impl", None)
        cells = getattr(compiled, "__closure__", None) or ()
        context = next((cell.cell_contents for cell in cells if hasattr(cell.cell_contents, "fullgraph")), None)
    return getattr(context, "fullgraph", False) is True


def refuse_unworkable(compiled: CompiledModel, stage: int, units: list[tuple[str, nn.Module]]) -> None:
    """Raise for what cannot work: stage 3 gathers and releases each unit in a forward hook, which must run
    as Python between graphs; inside a region compiled with fullgraph=True that break is an error. `units` are
    stage 3's gathered units (name, module); a unit compiled on its own keeps its hooks outside its graph."""
    if stage != 3 or not units or not compiled.fullgraph:
        return
    inside = [name for name, _ in units if _inside_fullgraph(name, compiled.fullgraph)]
    if not inside:
        return
    where = "torch.compile(model, fullgraph=True)" if "" in compiled.fullgraph else \
        f"fullgraph=True on {', '.join(n for n in compiled.fullgraph if n)}"
    raise ZerorunError(
        f"ZeRO stage 3 with {where}: stage 3 gathers each unit's parameters ({', '.join(inside[:3])}"
        f"{', ...' if len(inside) > 3 else ''}) in a forward hook that runs between compiled graphs, and "
        f"fullgraph=True makes that graph break an error. Compile each unit on its own instead (e.g. "
        f"`model.blocks[i] = torch.compile(block, fullgraph=True)` or `block.compile(fullgraph=True)` for each "
        f"block: their hooks then stay outside the graph), or drop fullgraph=True, or use zero.stage 2 "
        f"(docs/profiling-and-compiling.md).")


def _inside_fullgraph(unit: str, fullgraph: list[str]) -> bool:
    """A unit named `unit` lies strictly inside a module compiled with fullgraph=True (the root "" included)."""
    return any(region == "" or unit.startswith(region + ".") for region in fullgraph if region != unit)


def refuse_compiled_since(before: CompiledModel, model: nn.Module) -> None:
    """Raise if `model` was compiled after `initialize` (`before` is what it saw then): zerorun marked its hooks
    for torch.compile while dynamo was not loaded, so unmarked ones would be traced into a graph (at stage 3, a
    crash in backward). The engine asks once, at the first forward after dynamo is loaded."""
    now = inspect(model)
    if now.any and not before.any:
        what = "torch.compile(model)" if now.whole else f"{', '.join(now.parts[:3])} compiled"
        raise ZerorunError(f"the model was compiled after zerorun.initialize ({what}): zerorun prepares its hooks "
                           "for torch.compile when it initializes. Compile the model, or each block, before "
                           "zerorun.initialize (docs/profiling-and-compiling.md).")


def stage3_whole_model_note(compiled: CompiledModel, units: int) -> str | None:
    """What rank 0 says when stage 3 meets torch.compile(model): what dynamo then compiles, and the better way."""
    if not compiled.whole or not units:
        return None
    return (f"zerorun: stage 3 with torch.compile(model): the {units} units' gathers are graph breaks inside the "
            "root's forward, so dynamo compiles each unit's forward on its own and runs the root's own code (e.g. "
            "embeddings, the head, the loss) eagerly; a unit called through torch.utils.checkpoint is then not "
            "compiled at all. Compiling each unit instead (model.blocks[i] = torch.compile(block)) compiles the "
            "same graphs, and with activation checkpointing too.")
