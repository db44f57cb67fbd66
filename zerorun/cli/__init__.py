"""The `zerorun` command line: `app` (typer) and `main`, the console script's entry point.

    app.py         the commands: launch, submit, estimate, report, env, tune, and the groups below
    bench.py       `zerorun bench ...`: step time, kernels, I/O, checkpoints, the GPU check
    checkpoint.py  `zerorun checkpoint info|consolidate|upgrade`
    tune.py        `zerorun tune`
    suggest.py     the nearest real flag (or recipe key) to an unknown one
    counts.py      counts as option values: 7B, 1.5e9, 350M
"""

from zerorun.cli.app import app, main

__all__ = ["app", "main"]
