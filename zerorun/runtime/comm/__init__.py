"""How ranks talk: process-group setup (dist), the collectives each stage calls (collectives) and the one table
of which backend primitive each uses per backend and device (wire), what they return and count (handles), the
shared-memory transport for CPU ranks on one host (shm_collectives), the two-level hierarchy across nodes
(hier_collectives), and ZeRO++'s block-int8 codec (quantize) with the rule that turns it on where it pays
(compression).

Owns every torch.distributed call the runtime makes. Imports nothing else from the runtime but its foundation (the
`Runtime` a group's shared-memory segment is kept in, runtime/context.py): the stores, the reducer and checkpoints
depend on it, never the reverse.
"""
