"""`deepspeed.runtime`: `lr_schedules`, `engine` and the `zero.partition_parameters` hooks transformers reaches."""
