"""The README's DeepSpeed key table is the key table in zerorun/ds_keys.py."""

from __future__ import annotations

import re
from pathlib import Path

from zerorun import ds_keys

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_readme_deepspeed_key_table_equals_the_rules() -> None:
    section = re.search(r"<!-- deepspeed-keys:start -->\n(.*?)<!-- deepspeed-keys:end -->", README, re.S)
    assert section, "README lost its deepspeed-keys markers"
    assert section.group(1).strip() == ds_keys.reference_markdown().strip(), (
        "README's DeepSpeed key table is stale: regenerate it with "
        "python -c 'from zerorun import ds_keys; print(ds_keys.reference_markdown())'")
