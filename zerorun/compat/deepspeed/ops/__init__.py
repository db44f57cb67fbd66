"""`deepspeed.ops`: only `deepspeed.ops.adam` (accelerate asks for it when the optimizer is offloaded)."""
