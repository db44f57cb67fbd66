"""`deepspeed.checkpoint`: only `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`."""
