"""`zerorun checkpoint consolidate --format hf`: the model directory a Hugging Face from_pretrained reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from zerorun.compat import hf_export
from zerorun.errors import ZerorunError


def test_weights_are_sharded_past_the_limit_with_an_index_and_tied_weights_written_once(tmp_path: Path) -> None:
    embed = torch.arange(12.0).view(4, 3)
    state = {"embed.weight": embed, "block.weight": torch.ones(5, 3), "block.bias": torch.zeros(5),
             "head.weight": embed}  # tied: the same tensor under a second name
    (tmp_path / "config.json").write_text('{"model_type": "toy"}')
    files = hf_export.write(state, tmp_path / "out", tmp_path / "config.json", max_shard_bytes=80)
    index = json.loads((tmp_path / "out" / hf_export.INDEX).read_text())
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["weight_map"] == {"embed.weight": files[0].name, "block.weight": files[1].name,
                                   "block.bias": files[1].name}
    assert index["metadata"]["total_size"] == (12 + 15 + 5) * 4
    with safe_open(str(files[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"} and torch.equal(f.get_tensor("embed.weight"), embed)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == {"model_type": "toy"}
    single = hf_export.write(state, tmp_path / "one", tmp_path / "config.json", max_shard_bytes=2**20)
    assert [f.name for f in single] == [hf_export.WEIGHTS] and not (tmp_path / "one" / hf_export.INDEX).exists()


def test_the_config_comes_from_beside_the_checkpoint_or_is_asked_for(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    with pytest.raises(ZerorunError, match="no config.json in .*checkpoint-2 or its parent; pass --config"):
        hf_export.find_config(checkpoint, None)
    (tmp_path / "config.json").write_text("{}")
    assert hf_export.find_config(checkpoint, None) == tmp_path / "config.json"
    assert hf_export.find_config(checkpoint, tmp_path) == tmp_path / "config.json"
