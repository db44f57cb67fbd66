"""`deepspeed.accelerator.get_accelerator()`: the calls DeepSpeed's examples make, on CUDA or the CPU.

    from deepspeed.accelerator import get_accelerator
    device = torch.device(get_accelerator().device_name(local_rank))

Only what training scripts commonly use is here; anything else fails with a message naming it.
"""

from __future__ import annotations

from typing import Any

import torch


class Accelerator:
    """CUDA where torch sees a GPU, else the CPU (gloo), as zerorun's launcher chooses."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        if not self._cuda:
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def __getattr__(self, name: str) -> Any:  # only reached for names not defined above
        raise AttributeError(f"get_accelerator().{name} is not provided by zerorun's DeepSpeed compatibility: "
                             "use torch.cuda / torch.device directly.")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The one accelerator object, as DeepSpeed's (built on first use)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
