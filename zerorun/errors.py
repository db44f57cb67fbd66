"""Errors a user can cause, each naming where the problem is and what to do.

Everything a user can get wrong (a recipe key, a hostfile line, a flag) raises a subclass of
`ZerorunError`; the CLI prints its message without a traceback and exits with status 2. Internal
invariants are plain `assert`s: those are our bugs, not the user's.
"""

from __future__ import annotations


class ZerorunError(Exception):
    """Base class: a problem the user can fix; the message says where and how."""


class ConfigError(ZerorunError):
    """A recipe or a `--set` override is invalid (names file:line and the dotted key)."""


class HostfileError(ZerorunError):
    """A hostfile or an --include/--exclude/--num-nodes/--num-gpus selection is invalid."""


class LaunchError(ZerorunError):
    """The job could not be started (missing torchrun, port in use, ...)."""


class ZerorunWarning(UserWarning):
    """A configuration that works but is probably not what the user meant (the message says what to set)."""
