"""Coming from DeepSpeed: its config, its command line and its Python API, on zerorun.

- `zerorun.config.ds_config` (+ the key table `zerorun.config.ds_keys`), outside this package
  because `config` uses them too: a `ds_config.json` as recipe data, every key mapped, warned about or refused by
  name. `config.load` uses it for a recipe's `deepspeed_config`, and `zerorun convert` writes it
  out as a commented recipe (`convert`).
- `schedulers`: DeepSpeed's learning-rate schedules with its exact formulas.
- `api` and `engine`: `initialize`, `add_config_arguments`, `init_distributed` and the
  `DeepSpeedEngine` facade over zerorun's public Engine API.
- `deepspeed/`: the package a script gets for `import deepspeed` when the recipe sets
  `launch.deepspeed_compat` (`shim` installs it); always importable as `zerorun.compat.deepspeed`.
- `cmdline`: `zerorun launch script.py --deepspeed_config ds.json ...` as a recipe.

Nothing below `compat` imports it: `config` reads a `deepspeed_config` through `zerorun.config.ds_config`,
a module that imports nothing above `errors`, so `config -> compat -> runtime -> config` is no circle.
"""
