"""distrun: TensorFlow-style distribution strategies and a cluster runner for PyTorch.

Importing ``distrun`` is cheap and never imports torch: the CLI, the client and
the worker server live on this side. Recipes reach the Strategy API through
``distrun.strategies`` (which does import torch) or, more often, simply receive a
strategy as the argument of ``main(strategy)``.
"""

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
