"""Where the real DeepSpeed is installed: the interpreter that has it, or a clean skip.

CI does not install DeepSpeed; on a machine that does (`pip install deepspeed`, CPU accelerator),
the parity tests run a script under it and compare. `ZERORUN_DEEPSPEED_PYTHON` names another
interpreter that has it (default: this one).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import deepspeed, sys; sys.exit('zerorun' in deepspeed.__version__)"


def deepspeed_python() -> str:
    """The interpreter whose `import deepspeed` is the real DeepSpeed; skip the test where there is none."""
    python = os.environ.get("ZERORUN_DEEPSPEED_PYTHON", sys.executable)
    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if probe.returncode != 0:
        pytest.skip(f"the real DeepSpeed is not importable by {python} (or `deepspeed` there is zerorun's shim): "
                    "set ZERORUN_DEEPSPEED_PYTHON to an interpreter that has it, e.g. a venv with "
                    "`pip install deepspeed`")
    return python
