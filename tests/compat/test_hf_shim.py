"""What transformers and accelerate check and import of DeepSpeed, answered by zerorun's shim (no HF needed)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys

import pytest
import torch

from tests.harness import run_ranks
from zerorun import config
from zerorun.compat import cmdline, shim
from zerorun.errors import ZerorunError


def test_transformers_form_of_the_deepspeed_argument_names_the_config() -> None:
    assert cmdline.deepspeed_config_arg(["--deepspeed", "ds.json", "--bf16"]) == "ds.json"
    assert cmdline.deepspeed_config_arg(["--output_dir", "o", "--deepspeed=conf/ds.JSON"]) == "conf/ds.JSON"
    assert cmdline.deepspeed_config_arg(["--deepspeed", "--deepspeed_config", "a.json"]) == "a.json"
    assert cmdline.deepspeed_config_arg(["--deepspeed", "data.txt"]) is None  # DeepSpeed's flag, then the script's


@pytest.fixture
def installed_shim():
    saved_modules = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    saved_path = list(sys.meta_path)
    yield shim.install(config.loads("script: t.py\nlaunch: {deepspeed_compat: true}\n"), [])
    for name in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
        del sys.modules[name]
    sys.modules.update(saved_modules)
    sys.meta_path[:] = saved_path


def test_availability_checks_find_zeroruns_shim_with_a_version_they_accept(installed_shim) -> None:
    assert importlib.util.find_spec("deepspeed").name == "zerorun.compat.deepspeed"
    version = importlib.metadata.version("deepspeed")  # a real DeepSpeed in the environment does not win
    assert version.startswith("0.19.8+zerorun.")
    assert "zerorun" in importlib.metadata.metadata("deepspeed")["Summary"]
    packaging = pytest.importorskip("packaging.version")
    assert packaging.parse(version) >= packaging.parse("0.16.4")  # accelerate's highest minimum


def test_the_shim_installs_while_another_thread_imports() -> None:
    """A rank's telemetry probe runs in a thread of its own from before the shim is installed, and may import then:
    installing reads a snapshot of `sys.modules`. Iterating the live dict raised "dictionary changed size during
    iteration" in one rank of a real launch (nanoGPT's train.py), which ended the job before the script began."""
    import threading
    import types

    saved_modules = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    saved_path, saved_interval = list(sys.meta_path), sys.getswitchinterval()
    stop = threading.Event()

    def imports() -> None:  # modules come and go as in a thread that imports
        names = [f"_zerorun_test_import_{i}" for i in range(64)]
        while not stop.is_set():
            for name in names:
                sys.modules[name] = types.ModuleType(name)
            for name in names:
                del sys.modules[name]

    thread = threading.Thread(target=imports, daemon=True)
    sys.setswitchinterval(1e-6)  # the threads take turns often: the race shows within a few installs
    thread.start()
    try:
        for _ in range(200):
            shim.install_modules()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(saved_interval)
        for name in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        sys.meta_path[:] = saved_path


def test_a_real_deepspeed_imported_before_the_shim_no_longer_answers() -> None:
    import types

    saved_modules = {k: v for k, v in sys.modules.items() if k == "deepspeed" or k.startswith("deepspeed.")}
    saved_path = list(sys.meta_path)
    sys.modules["deepspeed.pipe"] = types.ModuleType("deepspeed.pipe")  # as a real DeepSpeed leaves it
    try:
        shim.install(config.loads("script: t.py\nlaunch: {deepspeed_compat: true}\n"), [])
        with pytest.raises(ModuleNotFoundError, match="deepspeed.pipe is not provided by zerorun"):
            importlib.import_module("deepspeed.pipe")
    finally:
        for name in [k for k in sys.modules if k == "deepspeed" or k.startswith("deepspeed.")]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        sys.meta_path[:] = saved_path


def test_the_submodules_transformers_and_accelerate_import_are_zeroruns(installed_shim) -> None:
    from deepspeed import DeepSpeedEngine
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.utils import logger, set_z3_leaf_modules

    assert DeepSpeedEngine.__module__ == "zerorun.compat.engine"
    assert "WarmupDecayLR" in lr_schedules.VALID_LR_SCHEDULES and "LambdaLR" not in lr_schedules.VALID_LR_SCHEDULES
    logger.setLevel("WARNING")
    assert pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_arange, torch.float16) is torch.arange
    base = torch.arange(6.0)
    cloned = clone_tensors_for_torch_save({"w": [base[:2]]})
    assert torch.equal(cloned["w"][0], base[:2]) and cloned["w"][0].untyped_storage().nbytes() == 8
    params = [torch.nn.Parameter(torch.ones(2))]
    adam = DeepSpeedCPUAdam(params, lr=0.1, weight_decay=0.01, adamw_mode=False)  # accelerate's offload mapping
    assert type(adam) is torch.optim.Adam and adam.defaults["weight_decay"] == 0.01
    with pytest.raises(ZerorunError, match="set_z3_leaf_modules .*zero.wrap"):
        set_z3_leaf_modules(torch.nn.Linear(1, 1), [torch.nn.Linear])
    assert DeepSpeedCPUAdam(params, amsgrad=True).defaults["amsgrad"]  # torch's AMSGrad, which zerorun runs exactly
    with pytest.raises(ZerorunError, match="bias_correction=False"):
        DeepSpeedCPUAdam(params, bias_correction=False)
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.lion import DeepSpeedCPULion

    import zerorun  # accelerate's offload mapping of an Adagrad and a Lion
    assert type(DeepSpeedCPUAdagrad(params, lr=0.1)) is torch.optim.Adagrad
    assert type(DeepSpeedCPULion(params, lr=1e-4, weight_decay=0.1)) is zerorun.Lion


def _gathered_before_initialize(rank: int, world: int) -> dict:
    from zerorun.compat import deepspeed

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    first, second = model
    assert first.weight.is_meta
    with torch.no_grad():
        second.weight.fill_(5.0)  # outside a gathering block: dropped, as DeepSpeed drops writes to a partition
    with deepspeed.zero.GatheredParameters([first.bias, first.weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                first.weight.fill_(float(world))  # rank 0's values are the ones kept
    assert first.weight.is_meta  # partitioned again
    engine, *_ = deepspeed.initialize(model=model, config_params=ds)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):  # now the engine's gathering
        values = {name: p.detach().tolist() for name, p in model.named_parameters()}
    return values


def test_parameters_before_initialize_change_only_inside_gathering_blocks() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for values in run_ranks(_gathered_before_initialize, 2):
        assert values["0.weight"] == torch.full((4, 3), 2.0).tolist()
        assert values["0.bias"] == plain[0].bias.tolist()
        assert values["1.weight"] == plain[1].weight.tolist()  # the write outside was dropped


def _gathered_on_nccl(rank: int, world: int) -> tuple[dict, set[tuple[str, str]]]:
    """The same script on GPUs over NCCL (stood in for on the CPU): the model is built on the host inside zero.Init,
    and NCCL carries device memory only."""
    from tests.runtime.cuda_standin import pretend_cuda
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()  # the real process group, gloo underneath; pretend_cuda then reports nccl
    os.environ.update(LOCAL_WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    with pretend_cuda("nccl") as seen:
        return _gathered_before_initialize(rank, world), seen


def test_parameters_gathered_before_initialize_travel_on_the_gpu_over_nccl() -> None:
    on_cpu = run_ranks(_gathered_before_initialize, 2)
    for (values, seen), expected in zip(run_ranks(_gathered_on_nccl, 2), on_cpu):
        assert values == expected
        assert {("all_gather_into_tensor", "cuda"), ("broadcast", "cuda")} <= seen, seen


def test_a_module_built_on_a_stage3_parameters_meta_device_is_refused_naming_resize_token_embeddings() -> None:
    """transformers' resize_token_embeddings at stage 3 builds the new embedding on the old weight's device, which
    zerorun's placeholders make meta: its initialisation is lost, so gathering it is refused with what to do."""
    from zerorun.compat import deepspeed

    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=ds):
        old = torch.nn.Embedding(4, 3)
    new = torch.nn.Embedding(6, 3, device=old.weight.device)
    with pytest.raises(ZerorunError, match=r"shape \(6, 3\).*resize_token_embeddings.*save_pretrained first"):
        with deepspeed.zero.GatheredParameters([old.weight, new.weight], modifier_rank=0):
            pass
