"""Fixtures the compat tests share across modules."""

from tests.compat.hf_runs import hf_workdir  # noqa: F401  (the session's Hugging Face model and runs)
