"""The engine's forward puts every tensor input on its device and floating ones in the compute dtype."""

from __future__ import annotations

from collections import namedtuple

import torch

from zerorun.runtime.devices import place_inputs

Pair = namedtuple("Pair", "tokens mask")


def test_inputs_reach_the_engines_device_nested_and_untouched_otherwise() -> None:
    # the meta device stands in for a GPU: a CPU batch must leave the CPU, whatever its nesting
    batch = {"ids": torch.arange(6).view(2, 3), "pair": Pair(torch.ones(2), [torch.zeros(3, dtype=torch.float64), 7]),
             "name": "b0"}
    (args, kwargs) = place_inputs(((batch,), {"scale": torch.tensor(0.5)}), torch.device("meta"), torch.bfloat16)
    placed = args[0]
    assert placed["ids"].device.type == "meta" and placed["ids"].dtype == torch.int64  # integers keep their type
    assert isinstance(placed["pair"], Pair) and placed["pair"].tokens.dtype == torch.bfloat16
    assert placed["pair"].mask[0].device.type == "meta" and placed["pair"].mask[0].dtype == torch.bfloat16
    assert placed["pair"].mask[1] == 7 and placed["name"] == "b0"
    assert kwargs["scale"].device.type == "meta" and kwargs["scale"].dtype == torch.bfloat16


def test_inputs_already_in_place_are_the_same_objects() -> None:
    x, y = torch.randn(3), torch.randn(3, dtype=torch.float64)
    (out_x, out_y), _ = place_inputs(((x, y), {}), torch.device("cpu"), torch.float32)
    assert out_x is x and out_y is y  # fp32 compute: nothing is cast, nothing copied
