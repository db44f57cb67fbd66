"""The ZeRO runtime injected into the user's script: the Engine and what it drives.

Top level, the step's core: engine (the public Engine), stage_setup (the store and reducer a stage
uses), store (the ParamStore protocol the engine calls), flat_params and deferred_publish (stages
0-2), grad_reducer (every stage's gradient buckets), accumulation, phase, precision, memory, events,
units and partition. Subpackages, each owning one concern: comm (collectives), offload (where state
lives), optim (the update), stage3 (sharded parameters), checkpoint, and interop (everything an
engine changes outside zerorun, undone by engine.destroy()). Dependencies point from the engine down to comm; no
subpackage imports another in a circle (tests/test_imports.py). Under them all, context (the Runtime an engine lives
in: what engines share, held in one object rather than in module globals, tests/test_runtime_state.py).
"""
