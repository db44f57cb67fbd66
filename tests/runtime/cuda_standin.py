"""A CUDA machine and its process groups, stood in for on a CPU: CUDA paths tested where no GPU is.

    with pretend_cuda(backend="gloo"):    # inside a rank process (tests.harness.run_ranks)
        engine = zerorun.initialize(model, optimizer, recipe)   # believes it runs on cuda:0
        ...

What the engine sees:
- `torch.cuda.is_available()` is True, one device; streams, events, `torch.cuda.stream(...)` and
  synchronisation are stand-ins that do nothing (every CPU operation is over when it returns);
- a tensor made on `cuda` (a factory with `device="cuda"`, `.to("cuda")`, `.cuda()`) is a
  `FakeCudaTensor`: real CPU memory whose `device` says cuda:0. Operations on it give FakeCudaTensors,
  `.cpu()` / `.to("cpu")` give a plain host copy, `pin_memory` is accepted and ignored;
- `torch.distributed` is the real gloo underneath, but its collectives and point-to-point calls
  first check each tensor against what the emulated backend carries (`wire.CARRIES`), and refuse
  what the real one would refuse, naming the call and the device: gloo moves host memory only in
  send/recv; NCCL moves device memory only. `dist.get_backend()` reports the
  emulated backend, so the runtime takes the paths it takes on that backend.

What it cannot see: speed, stream ordering (the CUDA stream sanitizer does that, on a GPU:
`zerorun bench gpu`) and the CUDA kernels: zerorun's CUDA kernels are unavailable inside it (their fallbacks
run), whatever build of torch is installed. With torch's CUDA build (pip's default) on a machine without a
GPU, `is_available()` patched to True let zerorun build and launch its CUDA Adam kernel on the stand-in's host
memory ("CUDA driver version is insufficient"): what the stand-in does must not depend on which torch it runs on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.cuda.nccl
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from zerorun import ops
from zerorun.runtime.comm.wire import CARRIES, Primitive

_DEVICE = [torch.device("cuda", 0)]  # this process's GPU: cuda:0 where ranks share one (gloo), cuda:<local rank> on nccl

# The torch.distributed calls behind each primitive of `wire.CARRIES` (what each real backend accepts)
_CALLS = {Primitive.POINT_TO_POINT: ("isend", "irecv", "send", "recv")}
CALLS: dict[str, Primitive] = {name: primitive for primitive in Primitive
                               for name in _CALLS.get(primitive, (primitive.value,))}


class Refused(RuntimeError):
    """What the real backend would have refused (or crashed on)."""


class FakeCudaTensor(torch.Tensor):
    """Host memory that says it is on cuda:0."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return _DEVICE[0]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def is_pinned(self, device: Any = None) -> bool:
        return False

    @classmethod
    def __torch_function__(cls, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:  # hooks that backward runs see torch functions, as they do on a GPU
            return _backward(*args, **kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.numpy) or (func is torch.Tensor.to and _target(args[1:], kwargs)
                                                             == "cpu"):
            with torch._C.DisableTorchFunctionSubclass():
                host = args[0].as_subclass(torch.Tensor)
                rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
                moved = host.clone() if func is not torch.Tensor.numpy else host
                if func is torch.Tensor.to:
                    others = [a for a in args[1:] if not _is_device(a)]
                    moved = moved.to(*others, **rest) if others or rest else moved
                return moved.numpy() if func is torch.Tensor.numpy else moved
        if func is torch.Tensor.cuda or (func is torch.Tensor.to and _target(args[1:], kwargs) == "cuda"):
            rest = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking")}
            others = [a for a in args[1:] if not _is_device(a) and not isinstance(a, int)]
            return args[0].to(*others, **rest) if func is torch.Tensor.to and (others or rest) else args[0]
        result = super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__") and args and isinstance(args[0], torch.Tensor):
            return args[0]  # in place: the tensor written to, whatever device its operands are on
        if isinstance(kwargs.get("out"), torch.Tensor):
            return kwargs["out"]
        return result


class FakeCudaParameter(FakeCudaTensor, torch.nn.Parameter):
    """A module's parameter whose data moved to the (pretended) GPU."""


def _backward(tensor: torch.Tensor, gradient: torch.Tensor | None = None, retain_graph: bool | None = None,
              create_graph: bool = False, inputs: Any = None) -> None:
    """`tensor.backward()` straight into autograd's engine: no torch-function dispatch on the way, so hooks run
    with torch functions (and this module's mode) on, not inside a handler that turned them off."""
    from torch.autograd.graph import _engine_run_backward

    gradient = torch.ones_like(tensor) if gradient is None else gradient
    _engine_run_backward((tensor,), (gradient,), create_graph if retain_graph is None else retain_graph,
                         create_graph, tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True)


def _is_device(value: Any) -> bool:
    return isinstance(value, torch.device) or (isinstance(value, str) and value.split(":")[0] in ("cpu", "cuda"))


def _device_type(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, int):
        return "cuda"
    return torch.device(value).type if _is_device(value) else None


def _target(args: tuple, kwargs: dict) -> str | None:
    """The device type a `.to(...)` call moves to, or None."""
    if "device" in kwargs:
        return _device_type(kwargs["device"])
    for value in args:
        if _is_device(value):
            return _device_type(value)
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


def _as_cuda(value: Any) -> Any:
    """`value` (a tensor just made) reclassed as a FakeCudaTensor: the same object, not an alias, so its views'
    `_base` is a FakeCudaTensor too."""
    if type(value) is torch.Tensor:
        value.__class__ = FakeCudaTensor
    elif isinstance(value, torch.Tensor) and not isinstance(value, FakeCudaTensor):
        return value.as_subclass(FakeCudaTensor)
    return value


_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.randn, torch.rand,
              torch.randint, torch.empty_strided, torch.linspace, torch.as_tensor, torch.empty_like, torch.zeros_like,
              torch.ones_like, torch.full_like}


def _pretending(run: Callable[[threading.Thread], None]) -> Callable[[threading.Thread], None]:
    """A thread started while the stand-in holds believes in the GPU too (the overlap's worker makes device tensors)."""
    @functools.wraps(run)
    def run_pretending(self: threading.Thread) -> None:
        with _PretendMode():
            run(self)
    return run_pretending


class _PretendMode(TorchFunctionMode):
    """Factories and moves to `cuda` make FakeCudaTensors; `pin_memory` is accepted and ignored."""

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.backward:
            with _PretendMode():  # the hooks backward runs see this mode too (a handler runs with its mode popped)
                return _backward(*args, **kwargs)
        if func in _FACTORIES:
            kwargs.pop("pin_memory", None)
            wants = _device_type(kwargs.get("device"))
            if wants == "cuda":
                kwargs["device"] = "cpu"
            elif wants is None and func.__name__.endswith("_like") and isinstance(args[0], FakeCudaTensor):
                wants = "cuda"
            result = func(*args, **kwargs)
            return _as_cuda(result) if wants == "cuda" else result
        if func == torch.Tensor.data.__set__:  # type: ignore[attr-defined]
            func(*args, **kwargs)
            owner, value = args
            if isinstance(value, FakeCudaTensor) and isinstance(owner, torch.nn.Parameter) \
                    and not isinstance(owner, FakeCudaParameter):
                owner.__class__ = FakeCudaParameter  # a module's parameter moved to the GPU is a GPU parameter
            return None
        if func == torch.Tensor.grad.__get__:  # type: ignore[attr-defined]
            grad = func(*args, **kwargs)
            return _as_cuda(grad) if isinstance(args[0], FakeCudaTensor) and grad is not None else grad
        if func is torch.Tensor.pin_memory:
            return args[0] if isinstance(args[0], FakeCudaTensor) else args[0].clone()
        if func in (torch.Tensor.to, torch.Tensor.cuda) and not isinstance(args[0], FakeCudaTensor):
            target = "cuda" if func is torch.Tensor.cuda else _target(args[1:], kwargs)
            if target == "cuda":
                kwargs.pop("device", None)
                kwargs.pop("non_blocking", None)
                others = [a for a in args[1:] if not _is_device(a) and not isinstance(a, int)]
                moved = args[0].to(*others, **kwargs) if others or kwargs else args[0]
                return _as_cuda(moved.clone() if moved is args[0] else moved)
        if func is torch.Tensor.copy_:
            kwargs.pop("non_blocking", None)
            args = args[:2]
        return func(*args, **kwargs)


class _Stream:
    cuda_stream = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _checked(name: str, real: Callable, backends: _Backends, seen: set[tuple[str, str]]) -> Callable:
    """`real` (a torch.distributed call), refusing what its group's backend does not carry; `seen` collects (call,
    device)."""

    @functools.wraps(real)
    def call(*args: Any, **kwargs: Any) -> Any:
        backend = backends.of(kwargs.get("group"))
        allowed = CARRIES[backend][CALLS[name]]
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        for tensor in tensors:
            kind = "cuda" if isinstance(tensor, FakeCudaTensor) else tensor.device.type
            if kind not in allowed:
                raise Refused(f"{backend} refuses dist.{name} of a {kind} tensor ({tuple(tensor.shape)}, "
                              f"{tensor.dtype}): it carries {', '.join(sorted(allowed))} tensors there")
            seen.add((name, kind))
        plain = [a.as_subclass(torch.Tensor) if isinstance(a, FakeCudaTensor) else a for a in args]
        return real(*plain, **{k: v.as_subclass(torch.Tensor) if isinstance(v, FakeCudaTensor) else v
                               for k, v in kwargs.items()})
    return call


class _Backends:
    """The emulated backend of each process group: the job's, or gloo for a group made with `backend="gloo"` (as a
    real NCCL job makes one for host tensors)."""

    def __init__(self, default: str) -> None:
        self.default = default
        self.gloo: list[Any] = []  # groups asked for as gloo (compared by identity)

    def of(self, group: Any = None) -> str:
        return "gloo" if group is not None and any(group is g for g in self.gloo) else self.default

    def new_group(self, real: Callable) -> Callable:
        @functools.wraps(real)
        def new_group(*args: Any, **kwargs: Any) -> Any:
            group = real(*args, **{k: v for k, v in kwargs.items() if k != "backend"}, backend="gloo")
            if str(kwargs.get("backend", "")).lower() == "gloo":
                self.gloo.append(group)
            return group
        return new_group


def _no_cuda_kernels(real: Callable[[str], str | None]) -> Callable[[str], str | None]:
    """`ops._unavailable_reason` for the stand-in: zerorun's CUDA kernels have no GPU to run on here."""

    def reason(kind: str) -> str | None:
        return "the CUDA stand-in has no GPU to run it (its fallback runs)" if ops.SPECS[kind].cuda else real(kind)
    return reason


def _init_on_gloo(real: Callable) -> Callable:
    """The real process group is gloo whatever the backend asked for (`get_backend` says the emulated one)."""

    @functools.wraps(real)
    def init(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        kwargs["backend"] = "gloo"
        return real(*args[1:], **kwargs) if args else real(**kwargs)
    return init


@contextlib.contextmanager
def pretend_cuda(backend: str = "gloo") -> Iterator[set[tuple[str, str]]]:
    """This process believes it has CUDA devices, and its process groups are `backend` (see the module docstring).
    Yields the set of (torch.distributed call, device type) the process made, filled in as it goes."""
    assert backend in CARRIES, backend
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = local_world if backend == "nccl" else 1  # NCCL: a GPU per rank; gloo: the ranks share one
    _DEVICE[0] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    backends = _Backends(backend)
    patches: dict[tuple[Any, str], Any] = {
        (torch.cuda, "is_available"): lambda: True,
        (torch.cuda, "device_count"): lambda: gpus,
        (torch.cuda, "set_device"): lambda device: None,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "Stream"): _Stream,
        (torch.cuda, "Event"): _Event,
        (torch.cuda, "stream"): lambda stream=None: contextlib.nullcontext(),
        (torch.cuda, "device"): lambda device=None: contextlib.nullcontext(),
        (torch.cuda, "current_stream"): lambda device=None: _Stream(),
        (torch.cuda, "default_stream"): lambda device=None: _Stream(),
        (torch.cuda, "synchronize"): lambda device=None: None,
        (torch.cuda, "memory_allocated"): lambda device=None: 0,
        (torch.cuda, "memory_reserved"): lambda device=None: 0,
        (torch.cuda, "max_memory_allocated"): lambda device=None: 0,
        (torch.cuda, "reset_peak_memory_stats"): lambda device=None: None,
        (torch.cuda, "empty_cache"): lambda: None,
        (torch.cuda, "get_rng_state_all"): lambda: [],
        (torch.cuda, "set_rng_state_all"): lambda states: None,
        (torch.cuda, "manual_seed_all"): lambda seed: None,
        (torch.cuda, "get_device_capability"): lambda device=None: (9, 0),
        (torch.cuda, "mem_get_info"): lambda device=None: (64 * 2**30, 80 * 2**30),
        (torch.cuda.nccl, "version"): lambda: (2, 21, 5),  # torch.distributed's error logging asks for it
        (dist, "get_backend"): backends.of,
        (ops, "_unavailable_reason"): _no_cuda_kernels(ops._unavailable_reason),
        (ops, "_loaded"): {},  # what this process loaded before (a CUDA kernel built for real, say) stays outside
        (dist, "init_process_group"): _init_on_gloo(dist.init_process_group),
        (dist, "new_group"): backends.new_group(dist.new_group),
        (threading.Thread, "run"): _pretending(threading.Thread.run),  # torch's modes are per thread
    }
    seen: set[tuple[str, str]] = set()
    for name in CALLS:
        patches[(dist, name)] = _checked(name, getattr(dist, name), backends, seen)
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        with _PretendMode():
            yield seen
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
