"""The planner's output: a rich table, the recommendation and notes, and JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerorun.estimate.plan import GIB, HEADROOM, Estimate

BUILT = {"device": "whole on GPU", "host": "on host", "meta": "sharded"}  # the "built" column: what setup counts
# left out first where the table is wider than the terminal (zerorun/tables.py): what decides a fit stays
DROP = ("buffers", "ckpt snapshot/node", "activations", "NVMe/node", "paper states", "master", "moments", "grads",
        "params")


def _gb(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def render(est: Estimate, paper: bool = False, width: int | None = None) -> Any:
    """One row per configuration, fastest first; fitted to `width` columns (tables.fit) where given."""
    from rich.console import Group

    from zerorun import tables

    c = est.cluster
    title = (f"{est.shape.params / 1e9:.3g}B params, {est.settings.precision}, {c.nodes} node(s) x "
             f"{c.gpus_per_node} GPU(s) (GiB per GPU, per node)")
    table = tables.compact(title)
    for col in ("configuration", "params", "grads", "master", "moments", "buffers", "activations", "GPU total", "built",
                "setup", *(["paper states"] if paper else []), "CPU/node", "ckpt snapshot/node", "NVMe/node", "fits"):
        table.add_column(col, justify="left" if col == "configuration" else "right",
                         overflow="fold" if col == "configuration" else "ellipsis")
    for r in est.rows:
        fits = "?" if r.fits is None else ("yes" if r.fits else "no")
        name = r.name + ("  <- recommended" if r is est.recommended else "")
        kinds = ("params", "grads", "master", "moments", "buffers", "activations")
        table.add_row(name, *(_gb(r.gpu[k]) for k in kinds),
                      _gb(r.gpu_total), BUILT[r.built_on], _gb(r.gpu_setup),
                      *([_gb(r.paper_model_states)] if paper else []),
                      _gb(r.cpu_per_rank * c.gpus_per_node), _gb(r.snapshot_per_node),
                      _gb(r.nvme_per_rank * c.gpus_per_node), fits)
    dropped = tables.fit(table, width, DROP) if width is not None else []
    return Group(table, *([tables.dropped_note(dropped, width)] if dropped else []))


def summary(est: Estimate) -> list[str]:
    """The recommendation and the notes, one line each."""
    best = est.recommended
    if est.cluster.gpu_mem_gib is None:
        lines = ["Give --gpu-mem (and --cpu-mem) to see which configurations fit."]
    elif best is None:
        lines = [f"Nothing fits: {', or '.join(remedies(est))}."]
    else:
        share = best.gpu_peak / (est.cluster.gpu_mem_gib * GIB)
        counted = "" if est.activations is not None else ", activations not counted"
        lines = [f"Recommended: {best.name} ({_gb(best.gpu_peak)} GiB per GPU, {share:.0%} of "
                 f"{est.cluster.gpu_mem_gib:g} GiB{counted}): the fastest configuration that fits"
                 + ("." if est.tight(best) else f" with {1 - HEADROOM:.0%} to spare.")]
        if est.tight(best):
            lines.append(f"Warning: no configuration leaves {1 - HEADROOM:.0%} of the GPU free; {best.name} uses "
                         f"{share:.0%}, with little room for the CUDA context, fragmentation"
                         f"{' and the activations' if est.activations is None else ''}: expect out-of-memory errors "
                         f"unless you {', or '.join(remedies(est))}.")
    return lines + [f"Note: {n}" for n in est.notes]


def remedies(est: Estimate) -> list[str]:
    """What would make a configuration fit, only among what the estimate counts (so the advice can be checked by
    running the estimate again with it)."""
    out = ["add GPUs or nodes (--nodes, --gpus-per-node)"]
    if est.activations is not None:
        out.append("shrink --micro-batch")
        if not est.settings.checkpointing:
            out.append("enable activation checkpointing (--checkpointing)")
    gpu = est.cluster.gpu_mem_gib * GIB if est.cluster.gpu_mem_gib is not None else float("inf")
    if any(r.built_on == "device" and r.stage == 3 and r.gpu_total <= gpu < r.gpu_setup for r in est.rows):
        out.append("build the model sharded at stage 3 (zerorun.sharded_init: --built-on meta)")
    if any(r.gpu_peak <= gpu and r.fits is False for r in est.rows):
        out.append("give the offload more host memory (--cpu-mem) or NVMe")
    return out


def as_json(est: Estimate) -> dict[str, Any]:
    best = est.recommended
    return {"model": dataclasses.asdict(est.shape), "cluster": dataclasses.asdict(est.cluster),
            "settings": dataclasses.asdict(est.settings),
            "activations": dataclasses.asdict(est.activations) if est.activations else None,
            "configurations": [{"stage": r.stage, "offload_optimizer": r.offload_optimizer,
                                "offload_param": r.offload_param, "gpu_bytes": r.gpu, "gpu_total_bytes": r.gpu_total,
                                "gpu_setup_bytes": r.gpu_setup, "built_on": r.built_on, "gpu_peak_bytes": r.gpu_peak,
                                "paper_model_states_bytes": r.paper_model_states,
                                "cpu_bytes_per_node": r.cpu_per_rank * est.cluster.gpus_per_node,
                                "nvme_bytes_per_node": r.nvme_per_rank * est.cluster.gpus_per_node,
                                "checkpoint_snapshot_bytes_per_node": r.snapshot_per_node,
                                "fits": r.fits} for r in est.rows],
            "recommended": best.name if best else None, "notes": est.notes}
