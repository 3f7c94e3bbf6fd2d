"""``distrun predict``'s part of a job: which checkpoint, and where the outputs go.

A predict job is a training job's processes (same placement, same strategies, same live view)
that load a checkpoint and run ``predict_data`` instead of fitting. What they need beyond the
JobSpec crosses to every rank in one environment variable (the spec's ``extra_env``, which the
local launcher, the worker servers and ``distrun node`` all pass on), as JSON: no job file
section holds it, as a predict job is no training job a file describes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from distrun.errors import ConfigError

__all__ = ["PREDICT_VAR", "PredictSpec"]

#: Set on every rank of a ``distrun predict`` job: the PredictSpec as JSON.
PREDICT_VAR = "DISTRUN_PREDICT"


@dataclass(frozen=True)
class PredictSpec:
    """``output``: the file rank 0 writes (absolute); ``checkpoint``: ``--checkpoint PATH``
    (absolute), or None for the newest in the job's ``--checkpoint-dir``."""

    output: str
    checkpoint: str | None = None

    def __post_init__(self) -> None:
        for name, value in (("--output", self.output), ("--checkpoint", self.checkpoint)):
            if value is not None and not os.path.isabs(value):
                raise ConfigError(f"predict: {name} must be an absolute path inside a job. Received: {value!r}")

    def to_env(self) -> dict[str, str]:
        return {PREDICT_VAR: json.dumps({"output": self.output, "checkpoint": self.checkpoint}, sort_keys=True)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PredictSpec | None:
        """The job's PredictSpec, or None in a training job."""
        text = environ.get(PREDICT_VAR)
        if not text:
            return None
        try:
            data = json.loads(text)
            return cls(output=str(data["output"]), checkpoint=data.get("checkpoint"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{PREDICT_VAR}: not a predict spec ({exc}); client and worker versions differ?") from None
