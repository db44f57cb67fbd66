"""A script's own `init_process_group()` joins the job; its own `destroy_process_group()` first finishes and checks.

Under `zerorun launch` the worker has joined the process group before the script runs (with the recipe's backend
and collective timeout), so that `torch.distributed` works from the script's first line. A torchrun script calls
`dist.init_process_group(...)` itself, and torch refuses a second one ("trying to initialize the default process
group twice"). While the worker holds these wrappers (installed before the script is imported, which may bind the
functions then; removed when the script returns):

- `init_process_group(...)` joins the job: with no backend, or one that fits this rank's device, it returns (the
  group is the one the worker made); a backend that cannot serve the device (`nccl` on CPU workers) is refused in
  one line naming the fix; another workable backend (`gloo` on GPUs) replaces the worker's group, built with the
  script's own arguments; a `world_size` or `rank` the job does not have is refused.
- `destroy_process_group()` first finishes the engines' collectives still in flight (gloo aborts a process whose
  group goes under a running collective) and meets the other ranks once more through the newest engine's checked
  collectives, so a rank whose peers still train is named, not left waiting (`LiveEngines.end_of_script`, runtime/context.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.runtime import context
from zerorun.runtime.interop.patches import AttributePatch, hold_all


def _settled(destroy: Callable[..., Any]) -> Callable[..., Any]:
    kept: list[Any] = []  # the groups the script destroyed, let go with this wrapper (see `hold`)

    @functools.wraps(destroy)
    def settled_destroy(*args: Any, **kwargs: Any) -> Any:
        group = args[0] if args else kwargs.get("group")
        if dist.is_initialized() and group is None:  # the default group, not a subgroup
            live = context.current().engines
            live.settle_all()
            live.end_of_script()
        kept.extend(_groups(group))
        return destroy(*args, **kwargs)
    return settled_destroy


def _groups(group: Any) -> list[Any]:
    """What `destroy_process_group(group)` ends: that group, or with None every group of the process."""
    if group is not None:
        return [group]
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {})) if dist.is_initialized() else []


def _joining(init: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(init)
    def join_the_job(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if not dist.is_initialized():  # the script tore the worker's group down: a fresh one, as it asks
            return init(backend, *args, **kwargs)
        refuse_unfit(backend, kwargs)
        if backend is None or wanted(backend) == dist.get_backend():
            return None  # joined: the group the worker made is this job's
        dist.destroy_process_group()  # nothing of zerorun's holds it yet: the script's own choice replaces it
        return init(backend, *args, **kwargs)
    return join_the_job


def wanted(backend: Any) -> str:
    """The backend `init_process_group(backend)` asks for on this rank's device ("cpu:gloo,cuda:nccl" resolved)."""
    text = str(backend).strip().lower()
    if ":" in text:
        per_device = dict(part.split(":", 1) for part in text.split(",") if ":" in part)
        return per_device.get("cuda" if torch.cuda.is_available() else "cpu", text)
    return text


def refuse_unfit(backend: Any, kwargs: dict[str, Any]) -> None:
    """Refuse what the job cannot be: NCCL without a GPU, another world size or rank."""
    if backend is not None and wanted(backend) == "nccl" and not torch.cuda.is_available():
        raise ZerorunError(f"the script calls init_process_group(backend={str(backend)!r}), but this worker has no "
                           f"GPU (torch sees no CUDA device) and NCCL runs on GPUs only. Pass backend='gloo', or "
                           f"leave it out: zerorun's worker has already joined the job (gloo on CPU workers).")
    for key, have in (("world_size", dist.get_world_size()), ("rank", dist.get_rank())):
        given = kwargs.get(key, -1)
        if given not in (-1, None) and int(given) != have:
            raise ZerorunError(f"the script calls init_process_group({key}={given}), but this job has "
                               f"{dist.get_world_size()} ranks and this is rank {dist.get_rank()}: leave {key} out "
                               f"(torchrun's and zerorun's workers set it in the environment).")


_DESTROY = AttributePatch(dist, "destroy_process_group", _settled)
_INIT = AttributePatch(dist, "init_process_group", _joining)


def hold() -> Callable[[], None]:
    """Hold both wrappers until the returned release is called.

    The groups the script destroyed stay referenced until then. A script's DDP module keeps its group through
    the C++ Reducer, and when the script's objects are freed (with the GIL held) after its own
    destroy_process_group(), the Reducer would drop the group's last reference: gloo's destructor then joins a
    worker thread that may be waiting for the GIL to free a finished collective's tensors, and the rank hangs
    at its end (seen under plain torchrun, py-spy: ~ProcessGroupGloo in std::thread::join). The worker releases
    this hold after it has freed the script's objects, so the last reference goes through torch's Python group
    object, which releases the GIL before it destroys."""
    return hold_all((_DESTROY, _INIT))
