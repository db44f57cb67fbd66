"""Imported last by the ranks' forkserver (`tests.harness.PRELOAD`): what it imported is frozen for its ranks.

`gc.freeze()` takes every object alive now out of the garbage collector's reach, in this process and in those it
forks: Python's own advice before forking without exec, and what a node's zygote does for warm ranks
(`zerorun/launch/warm.py`). Torch's and dynamo's objects live as long as the process anyway; left in the oldest
generation, every full collection in a rank walks them and writes its marks into each page it visits, which the
kernel then copies from the server. `python -m pytest -n 0 tests/runtime/test_checkpoint.py`: 26.3-26.6 s of
machine CPU before, 19.6-22.4 frozen. What a rank creates, its engine included, is collected as before.
"""

from zerorun.launch.warm import freeze_imports

freeze_imports()
