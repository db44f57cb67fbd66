"""The DeepSpeed-compatible API: the shim behind `import deepspeed`, initialize's rules, the facade's refusals."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from zerorun import config
from zerorun.compat import cmdline, shim


def test_everything_after_the_script_belongs_to_it() -> None:
    args = ["--num_gpus", "2", "-H", "hosts", "--dry-run", "train.py", "--deepspeed", "--num_gpus", "3"]
    head, tail = cmdline.split_script_args(args, {"--num_gpus", "-H"})
    assert head == args[:6] and tail == ["--deepspeed", "--num_gpus", "3"]
    assert cmdline.split_script_args(["r.yaml", "--dry-run"], set()) == (["r.yaml", "--dry-run"], [])
    assert cmdline.deepspeed_config_arg(["--deepspeed", "--deepspeed_config", "a.json"]) == "a.json"
    assert cmdline.deepspeed_config_arg(["--deepspeed_config=b.json"]) == "b.json"
    assert cmdline.deepspeed_config_arg(["--deepscale_config", "c.json"]) == "c.json"


@pytest.fixture
def installed_shim():
    saved_modules = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    saved_path = list(sys.meta_path)
    recipe = config.loads("script: t.py\nlaunch: {deepspeed_compat: true}\n")
    yield shim.install(recipe, ["--deepspeed"])
    for name in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
        del sys.modules[name]
    sys.modules.update(saved_modules)
    sys.meta_path[:] = saved_path


def test_the_switch_makes_import_deepspeed_zeroruns_and_names_what_it_lacks(installed_shim, monkeypatch) -> None:
    import deepspeed
    from deepspeed import comm

    assert deepspeed is importlib.import_module("zerorun.compat.deepspeed") and callable(deepspeed.initialize)
    assert comm.get_world_size is importlib.import_module("torch.distributed").get_world_size
    with pytest.raises(ModuleNotFoundError, match=r"deepspeed.pipe is not provided by zerorun.s DeepSpeed "
                                                  r"compatibility"):
        importlib.import_module("deepspeed.pipe")
    with pytest.raises(AttributeError, match=r"deepspeed.init_inference is not provided .*engine.module"):
        deepspeed.init_inference
    assert installed_shim == ["--local_rank=0", "--deepspeed"]  # where DeepSpeed's launcher puts it
    from deepspeed.accelerator import get_accelerator  # in most of DeepSpeed's current examples

    accelerator = get_accelerator()
    assert accelerator.device_name(0) == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert accelerator.communication_backend_name() == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(AttributeError, match=r"get_accelerator\(\).create_graph is not provided"):
        accelerator.create_graph


def _initialize_rules(rank: int, world: int, tmp: str) -> list[str]:
    import torch

    from zerorun.compat import deepspeed
    from zerorun.errors import ZerorunError

    seen = []
    model = torch.nn.Linear(4, 3)
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.5}}}
    args = argparse.Namespace(deepspeed_config=None)
    deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed", "--deepspeed_config", "x"])
    try:
        deepspeed.initialize(args=argparse.Namespace(deepspeed_config="x.json"), model=model, config=ds)
    except ZerorunError as exc:
        seen.append(f"both: {exc}")
    try:
        deepspeed.initialize(args=args, model=model, config={"train_micro_batch_size_per_gpu": 2})
    except ZerorunError as exc:
        seen.append(f"no optimizer: {exc}")
    groups = [{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}]
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    engine, optimizer, loader, schedule = deepspeed.initialize(args=args, model=model, model_parameters=groups,
                                                               training_data=data, config=ds)
    seen.append(f"groups: {[g['weight_decay'] for g in optimizer.param_groups]} schedule {schedule}")
    seen.append(f"loader: {[len(b[0]) for b in loader]}")  # micro-batches of 2 from this rank's share
    try:
        engine.backward(engine(torch.ones(2, 4)).sum(), retain_graph=True)
    except ZerorunError as exc:
        seen.append(f"retain_graph: {exc}")
    try:
        engine.no_sync()
    except AttributeError as exc:
        seen.append(f"no_sync: {exc}")
    seen.append(f"empty: {engine.load_checkpoint(tmp)}")
    return seen


def test_initialize_follows_deepspeeds_rules_and_refuses_by_name(tmp_path: Path) -> None:
    (seen,) = run_ranks(_initialize_rules, 1, (str(tmp_path / "none"),))
    text = "\n".join(seen)
    assert "both: a DeepSpeed config came both from --deepspeed_config and from initialize(config=...)" in text
    assert "no optimizer: no optimizer: the DeepSpeed config has no `optimizer` section" in text
    assert "groups: [0.5, 0.0] schedule None" in text  # the script's param groups, the config's hyper-parameters
    assert "retain_graph: engine.backward(retain_graph=True) is not supported" in text
    assert "no_sync: DeepSpeedEngine.no_sync is not provided by zerorun's DeepSpeed compatibility" in text
    assert "empty: (None, None)" in text
    assert "loader: [2, 2, 2, 2, 2]" in text
