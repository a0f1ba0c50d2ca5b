"""Typed errors for the user: the CLI turns each into one line and exit code 2."""

from __future__ import annotations


class PlanError(Exception):
    """A problem with the user's input or request (exit code 2)."""


class ModelLoadError(PlanError):
    """The model file or preset could not be loaded or built."""


class TraceError(PlanError):
    """Neither tracer could capture the model."""


class Infeasible(PlanError):
    """No layout satisfies the request (memory, divisibility, GPU count)."""


class PlanFileError(PlanError):
    """plan.json is malformed, fails its schema, or does not match the model file."""
