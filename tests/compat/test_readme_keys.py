"""The guide's DeepSpeed key table (docs/deepspeed.md) is the key table in zerorun/config/ds_keys.py."""

from __future__ import annotations

import re
from pathlib import Path

from zerorun.config import ds_keys

PAGE = (Path(__file__).parents[2] / "docs/deepspeed.md").read_text()


def test_docs_deepspeed_key_table_equals_the_rules() -> None:
    section = re.search(r"<!-- deepspeed-keys:start -->\n(.*?)<!-- deepspeed-keys:end -->", PAGE, re.S)
    assert section, "docs/deepspeed.md lost its deepspeed-keys markers"
    assert section.group(1).strip() == ds_keys.reference_markdown().strip(), (
        "docs/deepspeed.md's DeepSpeed key table is stale: regenerate it with "
        "python -c 'from zerorun.config import ds_keys; print(ds_keys.reference_markdown())'")
