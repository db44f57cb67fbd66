"""How ranks talk: process-group setup (dist), the collectives each stage calls and how each runs on
nccl and on gloo (collectives), the shared-memory transport for CPU ranks on one host
(shm_collectives) and the block-int8 codec of the quantized collectives (quantize).

Owns every torch.distributed call the runtime makes. Imports nothing else from the runtime: the
stores, the reducer and checkpoints depend on it, never the reverse.
"""
