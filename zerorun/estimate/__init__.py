"""The memory planner behind `zerorun estimate` (plan.py: the formulas; models.py: model shapes; render.py:
the table, the recommendation and JSON). `from zerorun import estimate` gives all of it."""

from __future__ import annotations

from zerorun.estimate.models import build_on_meta, load_factory, shape_from_size, shape_of
from zerorun.estimate.plan import (
                                   ADAM_K,
                                   BUILT_ON,
                                   GIB,
                                   HEADROOM,
                                   MIB,
                                   OFFLOADS,
                                   PARAM_BYTES,
                                   Activations,
                                   Cluster,
                                   Estimate,
                                   Footprint,
                                   ModelShape,
                                   Settings,
                                   activation_bytes,
                                   checkpoint_snapshot,
                                   configurations,
                                   estimate,
                                   model_states,
                                   network_copies,
                                   offload_buffers,
                                   optimizer_state,
                                   overlap_backup,
                                   paper_model_states,
                                   place,
                                   placed_states,
                                   setup_bytes,
                                   snapshot_holders_per_node,
                                   working_buffers,
)
from zerorun.estimate.render import as_json, render, summary

__all__ = ["ADAM_K", "BUILT_ON", "GIB", "HEADROOM", "MIB", "OFFLOADS", "PARAM_BYTES", "Activations", "Cluster",
           "Estimate", "Footprint", "ModelShape", "Settings", "activation_bytes", "as_json", "build_on_meta",
           "checkpoint_snapshot", "configurations", "estimate", "load_factory", "model_states", "network_copies",
           "offload_buffers", "optimizer_state", "overlap_backup", "paper_model_states", "place", "placed_states", "render",
           "setup_bytes", "shape_from_size", "shape_of", "snapshot_holders_per_node", "summary", "working_buffers"]
