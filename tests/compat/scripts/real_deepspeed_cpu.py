"""Run a Hugging Face script under the real DeepSpeed on CPU ranks: `torchrun real_deepspeed_cpu.py script.py ARGS`.

accelerate picks no distributed backend on a machine without an accelerator, so a Trainer with
`--deepspeed` on CPU would make every rank train alone under real DeepSpeed too. This launch joins
torchrun's gloo group first and gives accelerate zerorun's CPU backend answer (`zerorun.compat.hf_cpu`,
nothing of zerorun's DeepSpeed shim), then runs the script as `python script.py ARGS` would.
"""

from __future__ import annotations

import runpy
import sys

import torch.distributed as dist

from zerorun.compat import hf_cpu

if __name__ == "__main__":
    dist.init_process_group("gloo")
    hf_cpu.install()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
