"""Counts as people write them: `7B`, `1.5e9`, `350M`, `12K`, `7_000_000_000`: one parser for every count.

A model's size is said in billions (`7B`), a shard's in millions; a command line that wants a plain
`7000000000` (or refuses `7B` as "not a valid number") makes the user count zeros. Everywhere zerorun
asks for a count (`estimate --params`, `--largest-layer`, `bench scale --max-params`, `bench adam
--sizes`, an integer recipe key such as `train.steps` or `zero.param_persistence_threshold`) it reads
it here. The suffixes are powers of ten (a count of parameters or steps, not bytes): K 10^3, M 10^6,
B or G 10^9, T 10^12, either case. The value must come out a whole positive number.

This module imports nothing: the recipe converter (`config.convert`) and the command line both use it.
"""

from __future__ import annotations

import decimal
import re

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
EXAMPLES = "7B, 1.5e9, 350M or 7000000000"
_COUNT = re.compile(r"^\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([KMBGT]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """`'7B'` -> 7_000_000_000; ValueError with what was expected for anything else (zero, fractions,
    negative numbers, unknown suffixes)."""
    match = _COUNT.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a count; give a whole number such as {EXAMPLES} "
                         f"(suffixes K, M, B or G, T: powers of ten)")
    number, suffix = match.group(1).replace("_", "").replace(",", ""), match.group(2).upper()
    value = decimal.Decimal(number) * SUFFIXES.get(suffix, 1)  # exact: 7000000000123 stays itself
    if value != value.to_integral_value() or value > 2**63:
        raise ValueError(f"{text!r} is not a whole number; give a count such as {EXAMPLES}")
    if value <= 0:
        raise ValueError(f"{text!r}: a count must be at least 1, such as {EXAMPLES}")
    return int(value)
