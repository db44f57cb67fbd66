"""ZeRO stage 3: parameters sharded across ranks and gathered a unit at a time. The plan (which
modules become units, module_units), each unit group's state and transitions (unit_group), the
shards a gather reads (param_shards), a gather's buffers and collectives (sharded_params), the
hooks that decide when to gather, prefetch and release (param_scheduler), the engine's one object
for all of it (scheduled_params), hpZ's secondary copy (hpz) and sharded construction (sharded_init).

May import comm, offload and the runtime's core modules (store, units, memory, phase, precision);
only the engine imports it.
"""
