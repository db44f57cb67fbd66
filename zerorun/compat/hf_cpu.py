"""transformers and accelerate on CPU ranks under zerorun: two of their checks assume DeepSpeed means an accelerator.

- accelerate enters DeepSpeed mode only for a process that is not told `cpu=True`, and then picks
  its distributed backend from the accelerator it finds (nccl on CUDA, ...). On a machine with
  none it picks no backend at all, and every rank believes it is alone: one process, no sharded
  data, every rank saving the same files. zerorun runs the same job on CPU ranks over gloo (CI,
  laptops), with the process group already joined by its worker; so when accelerate finds no
  backend while that group exists and DeepSpeed mode is asked for, the answer becomes the group's
  backend as multi-CPU, which accelerate then turns into DeepSpeed mode with the right world size.
- transformers refuses `--bf16` unless the device is a GPU with bf16 or `--use_cpu` is given
  (`TrainingArguments.__post_init__`), and `--use_cpu` turns DeepSpeed off. zerorun trains bf16 on
  CPU ranks (its engine casts the model; fp32 master weights), so on a machine without CUDA its
  answer to "is bf16 available" is yes.

Nothing changes where CUDA is there, or for accelerate without DeepSpeed mode. `install()` applies
both when their modules are first imported (the worker calls it with the DeepSpeed shim).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any, Callable

ACCELERATE_STATE = "accelerate.state"
TRAINING_ARGS = "transformers.training_args"


def patch_accelerate(state: Any) -> None:
    """Wrap `PartialState._prepare_backend` in the imported `accelerate.state` module."""
    import torch.distributed as dist

    cls = state.PartialState
    original = cls._prepare_backend
    if getattr(original, "_zerorun", False):
        return

    def _prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None) -> Any:
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if chosen is None and not cpu and deepspeed and dist.is_available() and dist.is_initialized():
            return dist.get_backend(), state.DistributedType.MULTI_CPU
        return chosen, kind

    _prepare_backend._zerorun = True  # type: ignore[attr-defined]
    cls._prepare_backend = _prepare_backend


def patch_transformers(training_args: Any) -> None:
    """Make `transformers.training_args.is_torch_bf16_gpu_available` true on a machine without CUDA."""
    import torch

    original = training_args.is_torch_bf16_gpu_available
    if getattr(original, "_zerorun", False):
        return

    def is_torch_bf16_gpu_available() -> bool:
        return bool(original()) or not torch.cuda.is_available()

    is_torch_bf16_gpu_available._zerorun = True  # type: ignore[attr-defined]
    training_args.is_torch_bf16_gpu_available = is_torch_bf16_gpu_available


PATCHES: dict[str, Callable[[Any], None]] = {ACCELERATE_STATE: patch_accelerate, TRAINING_ARGS: patch_transformers}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a module of PATCHES through the other finders and patches it right after it executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                execute = spec.loader.exec_module

                def exec_module(module: Any) -> None:
                    execute(module)
                    patch(module)

                spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                return spec
        return None


def install() -> None:
    """Patch each module of PATCHES now if it is imported, else when it is."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
