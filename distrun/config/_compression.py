"""``--compression``: what a replica sends when gradients meet, as a frozen value.

Parsed here (the control plane), applied in ``strategies/communication/compression.py`` (the
training processes): ``none``, ``fp16``, ``bf16`` or ``powersgd[:RANK]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from distrun.config._suggest import did_you_mean
from distrun.errors import ConfigError

__all__ = ["Compression", "COMPRESSIONS", "DEFAULT_POWERSGD_RANK", "DEFAULT_POWERSGD_WARMUP"]

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
#: PowerSGD's rank when ``powersgd`` names none: 2, the rank PowerSGD's paper and
#: torch's own docs start from (rank 1 loses accuracy on most models).
DEFAULT_POWERSGD_RANK = 2
#: Plain all-reduce steps before PowerSGD starts (torch needs 2 or more: DDP rebuilds its
#: buckets after the first step; more steps let the loss settle before compressing).
DEFAULT_POWERSGD_WARMUP = 10


@dataclass(frozen=True)
class Compression:
    kind: str = "none"
    rank: int = 0  # PowerSGD's matrix approximation rank; 0 for the others

    @classmethod
    def parse(cls, text: str) -> Compression:
        kind, _, rank_text = str(text).partition(":")
        if kind not in COMPRESSIONS:
            raise ConfigError(f"--compression: expected none, fp16, bf16 or powersgd[:RANK]. Received: {text!r}"
                              f"{did_you_mean(kind, COMPRESSIONS)}")
        if kind != "powersgd":
            if rank_text:
                raise ConfigError(f"--compression {text}: only powersgd takes a rank (powersgd:RANK)")
            return cls(kind)
        if not rank_text:
            return cls(kind, DEFAULT_POWERSGD_RANK)
        if not rank_text.isdigit() or int(rank_text) < 1:
            raise ConfigError(f"--compression {text}: the PowerSGD rank must be a whole number of 1 or more")
        return cls(kind, int(rank_text))

    @property
    def active(self) -> bool:
        return self.kind != "none"

    def __str__(self) -> str:
        return f"powersgd:{self.rank}" if self.kind == "powersgd" else self.kind
