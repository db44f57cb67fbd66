"""The recipe: its schema, how it is read, validated and documented.

- `schema`: the dataclasses, the one definition of every key, type, default and bound;
- `load`: YAML files (line numbers, size bounds), `--set` overrides, the recipe a worker inherits;
- `ds_config` + `ds_keys`: a DeepSpeed JSON config as recipe data, every key accounted for;
- `convert`: plain data -> a validated `Recipe` (the generic converter and the cross-key rules);
- `reference`: docs/recipes.md's key table, rendered from the schema.

Every problem a user can make is one `ConfigError` naming the file, the line and the dotted key (or
the `--set` that caused it) and what was expected. The package imports nothing of zerorun's but
`errors`: everything else may import it.
"""

from __future__ import annotations

from zerorun.config.convert import (
    ENV_KEY,
    GIVEN_KEY,
    check_global_batch,
    from_dict,
    given_in,
    known_steps,
    to_dict,
    to_json,
)
from zerorun.config.load import (
    MAX_RECIPE_BYTES,
    MAX_YAML_NODES,
    RECIPE_ENV,
    RECIPE_FILE_ENV,
    from_env,
    load,
    loads,
)
from zerorun.config.reference import reference_markdown, reference_rows
from zerorun.config.schema import (
    BACKEND_ENV,
    AioConfig,
    CheckpointConfig,
    Dtype,
    LaunchConfig,
    OffloadConfig,
    OffloadDevice,
    OptimizerConfig,
    PrecisionConfig,
    Recipe,
    SchedulerConfig,
    SSHConfig,
    TelemetryConfig,
    TrainConfig,
    ZeroConfig,
    shorthand_of,
)
from zerorun.errors import ConfigError

__all__ = [
    "BACKEND_ENV", "ENV_KEY", "GIVEN_KEY", "MAX_RECIPE_BYTES", "MAX_YAML_NODES", "RECIPE_ENV", "RECIPE_FILE_ENV",
    "AioConfig", "CheckpointConfig", "ConfigError", "Dtype", "LaunchConfig", "OffloadConfig", "OffloadDevice",
    "OptimizerConfig", "PrecisionConfig", "Recipe", "SSHConfig", "SchedulerConfig", "TelemetryConfig",
    "TrainConfig", "ZeroConfig", "check_global_batch", "from_dict", "from_env", "given_in", "known_steps", "load",
    "loads", "reference_markdown", "reference_rows", "shorthand_of", "to_dict", "to_json",
]
