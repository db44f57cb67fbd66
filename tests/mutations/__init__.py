"""Regressions this project really had, put back one at a time to show the suite still catches each.

    python -m tests.mutations                  # each mutation against the files that test its area
    python -m tests.mutations --tier           # each against the development tier (-m "not slow") instead
    python -m tests.mutations --only NAME ...  # some of them; --list names them all

`table.py` holds the regressions (the commit that fixed each, the text that fixed it and the text before); `run.py`
applies each to a copy of the tree, never to the working tree, and runs pytest there.
"""
