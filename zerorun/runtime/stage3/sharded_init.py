"""`zerorun.sharded_init()`: build a model no rank could hold whole, with the values a normal build gives.

    with zerorun.sharded_init():
        model = GPT(cfg)                 # parameters are meta tensors: no memory
    engine = zerorun.initialize(model)   # each rank materialises only what it keeps

Inside the context, every parameter a module registers is swapped for a meta tensor (the real
`torch.empty` it was made from is freed at once; buffers stay real), and the in-place
initialisation ops applied to parameters (`normal_`, `uniform_`, `zero_`, `fill_`, `copy_`,
elementwise ops such as `mul_`) are recorded in order, with the RNG state at entry.

`InitLog.replay` reruns that log from the recorded RNG state. An op that a later op fully
overwrites still runs, into a scratch buffer, so the random stream advances exactly as in a
normal build; a parameter exists in full only from its last full overwrite to its last op, then
is handed to the consumer (stage 3 keeps this rank's pieces) and freed. So the peak is one
parameter, never the model, and the values equal a normal construction with the same seed.
On exit the context also advances the RNG past the model's initialisation, as a normal
construction would have, so data sampled afterwards is the same too.

Ops that cannot be replayed per parameter (a partial write through a view, a copy from another
meta tensor) raise a clear error when the log is replayed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zerorun.errors import ZerorunError

# Tensor methods that overwrite every element without reading the old values; every function of
# torch.nn.init does too (and is recorded whole: replaying it consumes the same random numbers)
OVERWRITE = {"normal_", "uniform_", "zero_", "fill_", "bernoulli_", "exponential_", "random_", "log_normal_",
             "cauchy_", "geometric_", "copy_"}
# in-place elementwise arithmetic an initialisation may apply after a fill (trunc_normal_'s, a rescale)
ELEMENTWISE = {"mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "abs_", "neg_",
               "exp_", "sqrt_", "pow_", "addcmul_", "addcdiv_", "lerp_", "sign_", "tanh_", "sigmoid_"}
PURE = {"zero_", "fill_", "copy_", "zeros_", "ones_", "constant_", "eye_", "dirac_"}  # consume no randomness


@dataclass
class RecordedOp:
    param: nn.Parameter
    name: str
    func: Callable[..., Any]
    args: tuple
    kwargs: dict


@dataclass
class InitLog:
    """Parameters created inside one `sharded_init` block and the ops that initialised them."""

    rng_state: torch.Tensor
    params: list[nn.Parameter] = field(default_factory=list)
    devices: dict[int, torch.device] = field(default_factory=dict)
    ops: list[RecordedOp] = field(default_factory=list)

    @staticmethod
    def overwrites(op: RecordedOp) -> bool:
        return op.name in OVERWRITE or getattr(op.func, "__module__", "") == "torch.nn.init"

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self.devices

    def replay(self, consume: Callable[[nn.Parameter, torch.Tensor], None], device: torch.device | None = None,
               only_rng: bool = False) -> None:
        """Rerun the log; `consume(param, full_value)` once per parameter, each as soon as it is final."""
        last_overwrite: dict[int, int] = {}
        last_op: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            last_op[id(op.param)] = i
            if self.overwrites(op):
                last_overwrite[id(op.param)] = i
        saved = torch.random.get_rng_state()
        torch.random.set_rng_state(self.rng_state)
        try:
            live: dict[int, torch.Tensor] = {}
            for i, op in enumerate(self.ops):
                key = id(op.param)
                target_device = device or self.devices[key]
                if only_rng or i < last_overwrite.get(key, -1):
                    if op.name not in PURE:  # dead value, but the random stream must advance
                        scratch = torch.empty(op.param.shape, dtype=op.param.dtype, device=target_device)
                        _call(op, scratch)
                    continue
                if key not in live:
                    live[key] = torch.empty(op.param.shape, dtype=op.param.dtype, device=target_device)
                    if not self.overwrites(op):
                        raise ZerorunError(f"sharded_init: {op.name} reads parameter {tuple(op.param.shape)} before "
                                           "anything initialised it; initialise it in place (normal_, uniform_, ...).")
                _call(op, live[key])
                if i == last_op[key]:
                    consume(op.param, live.pop(key))
            if not only_rng:
                for param in self.params:  # never initialised in place: torch.empty's contents, i.e. undefined
                    if not any(op.param is param for op in self.ops):
                        consume(param, torch.zeros(param.shape, dtype=param.dtype, device=device or self.devices[id(param)]))
        finally:
            if not only_rng:
                torch.random.set_rng_state(saved)


def _call(op: RecordedOp, target: torch.Tensor) -> None:
    args = tuple(_real(a, op) for a in op.args)
    kwargs = {k: _real(v, op) for k, v in op.kwargs.items()}
    with torch.no_grad():
        op.func(target, *args, **kwargs)


def _real(value: Any, op: RecordedOp) -> Any:
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise ZerorunError(f"sharded_init: {op.name} on parameter {tuple(op.param.shape)} reads another meta tensor; "
                           "only in-place initialisation from constants can be replayed (initialise it under "
                           "engine.gathered(modify=True) instead).")
    return value


def materialize(param: nn.Parameter, value: torch.Tensor) -> None:
    """Give `param` real data. A meta parameter cannot take `.data` from another device, so its
    contents are swapped in place: modules, optimizers and tied references keep the same object."""
    if param.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))
    else:
        param.data = value


class InitLogs:
    """A runtime's finished logs (runtime/context.py), where an engine built in it finds its model's."""

    def __init__(self) -> None:
        self._logs: list[InitLog] = []

    def add(self, log: InitLog) -> None:
        self._logs.append(log)

    def log_for(self, module: nn.Module) -> InitLog | None:
        """The log that created `module`'s meta parameters, if any."""
        params = [p for p in module.parameters() if p.is_meta]
        for log in self._logs:
            if params and log.owns(params[0]):
                return log
        return None

    def owning(self, params: Sequence[torch.Tensor]) -> list[InitLog]:
        """The finished logs that created any of `params` (meta parameters)."""
        return [log for log in self._logs if any(p.is_meta and log.owns(p) for p in params)]


class _Recorder(TorchFunctionMode):
    """Records in-place ops on the block's meta parameters (directly or through `.data`)."""

    def __init__(self, log: InitLog) -> None:
        super().__init__()
        self.log = log
        self.aliases: dict[int, nn.Parameter] = {}
        self._keep: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args:
            target, rest, options = args[0], args[1:], kwargs
        else:  # torch.nn.init functions dispatch with keywords: normal_(tensor=..., mean=..., std=...)
            target, rest = kwargs.get("tensor"), ()
            options = {k: v for k, v in kwargs.items() if k != "tensor"}
        param: nn.Parameter | None = None
        if isinstance(target, torch.Tensor) and target.is_meta:
            param = self.aliases.get(id(target))
            if param is None and self.log.owns(target):
                param = cast(nn.Parameter, target)  # one of the log's meta parameters
        if param is None:
            return func(*args, **kwargs)
        if name.endswith("_") and not name.startswith("_"):  # in place: first, since it returns its target
            if target.shape != param.shape:
                raise ZerorunError(f"sharded_init: {name} writes part of parameter {tuple(param.shape)} through a view; "
                                   "initialise whole parameters, or do it under engine.gathered(modify=True).")
            self.log.ops.append(RecordedOp(param, name, _method(func), rest, options))
            if _writes_values_only(func, name):
                return target  # a meta tensor has no values to write (see _writes_values_only)
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor) and result.is_meta and (name == "__get__" or result._is_view()):
            self.aliases[id(result)] = param  # `param.data`, or a view: writes through it reach the parameter
            self._keep.append(result)  # keep ids unique while recording
        return result


def _writes_values_only(func: Any, name: str) -> bool:
    """Whether in-place `func` only writes elements, leaving shape, strides and flags alone: on a meta
    tensor it then does nothing, and is not run. Running some of them there is not free: the meta
    kernels of `normal_`, `clamp_`, `erfinv_` (trunc_normal_) and others are Python references whose
    first call imports torch._dynamo, sympy and FSDP: tens of MiB of RSS per rank for the whole job."""
    return getattr(func, "__module__", "") == "torch.nn.init" or name in OVERWRITE or name in ELEMENTWISE


def _method(func: Any) -> Callable[..., Any]:
    """What to call on replay: the torch.nn.init function itself, else the unbound Tensor method."""
    if getattr(func, "__module__", "") == "torch.nn.init":
        return cast(Callable[..., Any], func)
    return cast(Callable[..., Any], getattr(torch.Tensor, func.__name__, func))


@contextlib.contextmanager
def sharded_init(logs: InitLogs) -> Iterator[InitLog]:
    """Create modules with meta parameters and a replayable record of their initialisation, kept in `logs` (the
    runtime's, where an engine looks for its model's)."""
    log = InitLog(torch.random.get_rng_state())
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and not log.owns(param):
            meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            log.devices[id(meta)] = param.device
            log.params.append(meta)
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    try:
        with _Recorder(log):
            yield log
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
    logs.add(log)
    log.replay(lambda p, t: None, only_rng=True)  # advance the RNG as a normal construction would have
