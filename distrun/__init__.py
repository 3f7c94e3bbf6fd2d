"""distrun: TensorFlow-style distribution strategies and a cluster runner for PyTorch.

Importing ``distrun`` is cheap and never imports torch: the CLI, the client and
the worker server live on this side. Recipes reach the Strategy API through
``distrun.strategies`` (which does import torch) or, more often, simply receive a
strategy as the argument of ``main(strategy)``.

``distrun.train(recipe, **options)`` and ``distrun.Cluster(path)`` run jobs and clusters
from Python (``distrun.api``, loaded on first use: docs/api.md).
"""

from typing import Any

from distrun._version import __version__
from distrun.errors import (
    CheckpointError,
    ConfigError,
    DistrunError,
    HostError,
    HostKeyError,
    HostUnreachable,
    Interrupted,
    RecipeError,
    TrainingError,
    UsageError,
)

__all__ = [
    "__version__",
    "train",
    "Cluster",
    "JobSummary",
    "DistrunError",
    "UsageError",
    "ConfigError",
    "RecipeError",
    "TrainingError",
    "CheckpointError",
    "HostError",
    "HostKeyError",
    "HostUnreachable",
    "Interrupted",
]


def __getattr__(name: str) -> Any:
    """``distrun.train``, ``distrun.Cluster``, ``distrun.JobSummary``: the API, imported when first used."""
    if name in ("train", "Cluster", "JobSummary"):
        from distrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'distrun' has no attribute {name!r}")
