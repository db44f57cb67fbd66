"""`deepspeed.ops`: the optimizer classes accelerate asks for when the optimizer is offloaded (`adam`, `adagrad`,
`lion`), as torch optimizers zerorun's engine runs like any other."""
