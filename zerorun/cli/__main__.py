"""`python -m zerorun.cli ...`: the same as the `zerorun` console script."""

from zerorun.cli import main

main()
