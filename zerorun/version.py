"""zerorun's version, importable without the package's API (checkpoints record it)."""

__version__ = "0.1.0"
