"""Slots become a node's own CUDA devices on the node (pure mapping fed a GPU count; no GPU needed)."""

from __future__ import annotations

import pytest

from zerorun.errors import LaunchError
from zerorun.launch import devices, node
from zerorun.launch.devices import visible_devices
from zerorun.launch.node import NodeJob


def test_slots_are_indices_of_the_gpus_the_node_sees():
    assert visible_devices("h", (0, 2), None, gpus=4) == "0,2"
    assert visible_devices("h", (0, 1), None, gpus=8) == "0,1"  # fewer slots than GPUs: only those
    assert visible_devices("h", (1,), None, gpus=2) == "1"


def test_a_node_that_narrows_its_gpus_maps_slots_through_its_own_cuda_visible_devices():
    assert visible_devices("h", (0, 2), "2,3,5", gpus=3) == "2,5"
    assert visible_devices("h", (1,), "GPU-aa,GPU-bb", gpus=2) == "GPU-bb"  # UUIDs too


def test_a_node_without_gpus_leaves_the_variable_alone():
    assert visible_devices("h", (0, 2), None, gpus=0) is None


def test_a_slot_the_node_does_not_have_is_an_error_naming_host_and_slot():
    with pytest.raises(LaunchError, match=r"host h: slot 3 does not exist: it has 2 GPU\(s\)"):
        visible_devices("h", (0, 3), None, gpus=2)
    with pytest.raises(LaunchError, match=r"slot 2 does not exist: CUDA_VISIBLE_DEVICES=4,5 leaves 2"):
        visible_devices("h", (2,), "4,5", gpus=2)


def test_the_node_supervisor_sets_cuda_visible_devices_from_the_slots_it_was_sent(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    job = NodeJob(("torchrun",), {"A": "1"}, "/", 1.0, slots=(0, 2))
    assert node._with_devices(job, "h") == {"A": "1", "CUDA_VISIBLE_DEVICES": "0,2"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3,5,7")  # what the node itself inherited
    assert node._with_devices(job, "h")["CUDA_VISIBLE_DEVICES"] == "1,5"
    recipe_env = NodeJob(("torchrun",), {"CUDA_VISIBLE_DEVICES": "6,7,8,9"}, "/", 1.0, slots=(1,))
    assert node._with_devices(recipe_env, "h")["CUDA_VISIBLE_DEVICES"] == "7"  # the recipe's env wins
    assert "CUDA_VISIBLE_DEVICES" not in node._with_devices(NodeJob(("t",), {}, "/", 1.0, slots=None), "h")
    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    assert node._with_devices(job, "h") == {"A": "1"}


def test_the_node_job_travels_as_one_json_line():
    job = NodeJob(("py", "-m", "x"), {"K": "v"}, "/w", 2.5, (0, 2), ("/nvme/r/rank-0",))
    line = job.header()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert NodeJob.from_header(line) == job


def test_nccl_takes_one_rank_per_gpu_and_gloo_lets_ranks_share_one():
    import torch

    from zerorun.errors import ZerorunError
    from zerorun.runtime.comm.dist import check_one_rank_per_gpu, choose_backend

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_backend(cuda, "auto") == "nccl" and choose_backend(cpu, "auto") == "gloo"
    assert choose_backend(cuda, "gloo") == "gloo" and choose_backend(cuda, " NCCL ") == "nccl"
    with pytest.raises(ZerorunError, match="nccl needs CUDA devices"):
        choose_backend(cpu, "nccl")
    with pytest.raises(ZerorunError, match=r"ZERORUN_BACKEND=mpi \(launch.backend\): expected one of auto, nccl"):
        choose_backend(cuda, "mpi")
    check_one_rank_per_gpu(2, 2)
    with pytest.raises(ZerorunError, match=r"2 ranks on this node but 1 GPU\(s\).*launch.backend: gloo"):
        check_one_rank_per_gpu(2, 1)


def test_launch_backend_reaches_every_worker_as_zerorun_backend():
    from tests.launch.test_plan import CPU, TWO_LOCAL, recipe
    from zerorun.launch.plan import plan

    assert all("ZERORUN_BACKEND" not in n.env for n in plan(recipe(), TWO_LOCAL, "j", 1, CPU).nodes)
    shared = plan(recipe(launch={"backend": "gloo"}), TWO_LOCAL, "j", 1, CPU)
    assert all(n.env["ZERORUN_BACKEND"] == "gloo" for n in shared.nodes)


def test_with_launch_backend_gloo_slots_wrap_onto_the_gpus_the_node_has():
    assert visible_devices("h", (0, 1), None, gpus=1, share=True) == "0"  # both ranks on GPU 0
    assert visible_devices("h", (0, 1, 2), "4,6", gpus=2, share=True) == "4,6"  # ranks 0, 1, 2 on 4, 6, 4
    assert visible_devices("h", (1,), None, gpus=2, share=True) == "1"
    with pytest.raises(LaunchError, match="set launch.backend: gloo"):
        visible_devices("h", (0, 1), None, gpus=1)


def test_the_node_maps_slots_onto_a_shared_gpu_only_under_gloo(monkeypatch):
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    shared = NodeJob(("torchrun",), {"ZERORUN_BACKEND": "gloo"}, "/", 1.0, slots=(0, 1))
    assert node._with_devices(shared, "h")["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(LaunchError, match="slot 1 does not exist"):
        node._with_devices(NodeJob(("torchrun",), {}, "/", 1.0, slots=(0, 1)), "h")
