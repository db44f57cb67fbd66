"""The regressions `python -m tests.mutations` puts back: each the fix's text, the text before it, and the tests
that must fail without the fix (pytest arguments: files, or node ids where the area's file is mostly slow)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    commit: str  # the commit that fixed it (or introduced the check this wave)
    regression: str  # what went wrong, as the project saw it
    path: str  # the file the fix lives in
    fixed: str  # the fixed text, found exactly once in `path`
    broken: str  # what stood there before the fix (or the check taken out)
    caught_by: tuple[str, ...]  # pytest arguments that must fail with the mutation (and pass without it)


MUTATIONS = [
    Mutation(
        "gloo-cuda-point-to-point", "5f34089",
        "CUDA tensors handed to gloo's isend: every multi-rank CUDA run over gloo died in its first backward",
        "zerorun/runtime/comm/wire.py",
        '("gloo", "cuda"): {op: Route(way.primitive, staged=True) for op, way in _HOST.items()},',
        '("gloo", "cuda"): {op: Route(way.primitive, staged=False) for op, way in _HOST.items()},',
        ("tests/runtime/test_wire.py", "tests/runtime/test_cuda_standin.py")),
    Mutation(
        "stall-report-behind", "bc10d39",
        "after handles.py split off collectives.py, a rank blocked in Handle.wait no longer counted as waiting: "
        "stall reports named no rank behind",
        "zerorun/telemetry/whereabouts.py",
        'os.sep + os.path.join("zerorun", "runtime", "comm") + os.sep)',
        'os.path.join("zerorun", "runtime", "comm", "collectives.py"))',
        ("tests/telemetry/test_whereabouts.py",)),
    Mutation(
        "example-hostfiles", "05ac12c",
        "the hostfile tests looked for the example hostfiles one level too low after moving into tests/launch/: "
        "two failed and two parametrized ones collected nothing",
        "tests/launch/test_hostfile.py",
        "ROOT = Path(__file__).resolve().parents[2]",
        "ROOT = Path(__file__).resolve().parents[1]",
        ("tests/launch/test_hostfile.py",)),
    Mutation(
        "nvme-truncation", "8d0fd42",
        "an NVMe store opened its files with O_TRUNC: a second store at the same path emptied the file an earlier, "
        "not yet collected one still held, whose cleanup then removed the second one's file",
        "zerorun/runtime/offload/nvme.py",
        "        path.unlink(missing_ok=True)\n        try:\n            try:\n"
        "                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)",
        "        try:\n            try:\n"
        "                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)",
        ("tests/runtime/test_nvme.py",)),
    Mutation(
        "unit-outside-every-group", "6833b50",
        "stage 3's gradients are taken by the unit groups' hooks alone: a unit outside every group is reduced as zeros",
        "zerorun/runtime/stage3/module_units.py",
        "    return Stage3Plan([*ordered, root, persistent], units,",
        "    return Stage3Plan([*ordered, root], units,",
        ("tests/runtime/test_stage3.py",)),
    Mutation(
        "hooks-after-destroy", "e04e7d4",
        "the reducer's and stage 3's hooks stayed on the script's model after engine.destroy()",
        "zerorun/runtime/interop/__init__.py",
        "        self._undo.append(remove_hooks)",
        "        del remove_hooks",
        ("tests/runtime/test_interop.py",)),
    Mutation(
        "deferred-publish-read", "5ea4f43",
        "with the publish deferred under the next forward, model.parameters() after engine.step() read half-gathered "
        "weights without a word (an EMA update, an AveragedModel)",
        "zerorun/runtime/interop/publish_guard.py",
        "        wait_all()\n        base: type[nn.Module] = type(self).__mro__[1]",
        "        base: type[nn.Module] = type(self).__mro__[1]",
        ("tests/runtime/test_publish_overlap.py",)),
    Mutation(
        "shared-memory-tag-unchecked", "02fe4cf",
        "a collective in shared memory whose ranks stand at different places: tags written but never compared",
        "zerorun/runtime/comm/shm_collectives.py",
        "        if self.pending is None:\n            return\n        self.pending = None\n"
        "        lines = self._lines[self.position % 2]",
        "        if True:\n            self.pending = None\n            return\n"
        "        lines = self._lines[self.position % 2]",
        ("tests/runtime/test_desync.py",)),
    Mutation(
        "wire-tag-unchecked", "02fe4cf",
        "a collective on the wire (gloo, NCCL) whose ranks stand at different places: no fingerprint all-reduce",
        "zerorun/runtime/comm/collectives.py",
        "            assert self.tags is not None\n            self.tags.on_wire(tag)",
        "            assert self.tags is not None",
        ("tests/runtime/test_desync.py",)),
    Mutation(
        "stage3-state-dict", "02fe4cf",
        "at stage 3 the model's own state_dict() (a DDP habit) held the empty tensors between gathers",
        "zerorun/runtime/interop/state_dict_gather.py",
        "            if prefix + name in state:\n                state[prefix + name] = value",
        "            pass",
        ("tests/runtime/test_desync.py",)),
    Mutation(
        "end-of-script-meeting", "6b3d7af",
        "a rank whose data loader ran out ended its script while its peers waited in their next collective",
        "zerorun/runtime/context.py",
        "        engines[-1].comm.end_of_script()\n        return True",
        "        return True",
        ("tests/launch/test_torchrun_scripts.py"
         "::test_a_data_loader_that_runs_out_on_one_rank_stops_the_job_naming_it",)),
    Mutation(
        "hf-gather-over-nccl", "33aed2d",
        "GatheredParameters before deepspeed.initialize handed host tensors to NCCL's all-gather: two GPUs failed in "
        "the first block",
        "zerorun/compat/staged_params.py",
        "    if carried is None or device.type in carried:\n        return device",
        "    if True:\n        return device",
        ("tests/compat/test_hf_shim.py",)),
    Mutation(
        "script-destroys-the-group-under-a-collective", "063d0c7",
        "a script's own destroy_process_group() tore the group down under a publish still in flight: gloo aborted "
        "the process",
        "zerorun/runtime/interop/process_group.py",
        "            live.settle_all()\n            live.end_of_script()",
        "            live.end_of_script()",
        ("tests/runtime/test_publish_overlap.py",)),
]
