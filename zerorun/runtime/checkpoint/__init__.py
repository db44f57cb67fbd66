"""Checkpoints that are whole or refused: the sharded save/load and resharding (sharded), the
files, their integrity and consolidation (files, manifest, safetensors_writer), the background
writer and its snapshot (background, snapshot), and the resume checks (resume_check).

May import comm, offload, optim and the runtime's core modules; only the engine and the command
line import it.
"""
