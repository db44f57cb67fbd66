"""Where the optimizer state and stage 3's parameter shard live: the Placement chosen from the
recipe, the Home that holds master weights and moments (device or host memory, or NVMe files), the
Transfers that move tiles between host and device, and the NVMe ring and its asynchronous I/O.

May import runtime.memory (accounting) and runtime.partition (shard arithmetic); nothing above them.
"""
