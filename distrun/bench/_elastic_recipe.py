"""`distrun bench elastic`: a fit-style workload whose rank ``--die-rank`` is SIGKILLed once.

An MLP of 1.3M parameters (two hidden layers of 1024) under Adam, so a heal moves real
state: parameters and both Adam moments, 16 MB. Rank ``--die-rank`` SIGKILLs itself
in the forward of its ``--die-at``-th step, unless the ``--once`` file exists (it makes
the file first): a restarted job does not die again. ``--sleep-s`` slows every step a
little, so the steps around the failure are spread out enough to time.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 96}


def _arg(name: str, default: object) -> object:
    return type(default)(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


DIE_RANK, DIE_AT, ONCE, SLEEP_S = _arg("--die-rank", -1), _arg("--die-at", 0), _arg("--once", ""), _arg("--sleep-s", 0.0)
RANK = int(os.environ.get("RANK", "0"))
_calls = 0


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def optimizer(params):  # noqa: ANN001, ANN201 - the recipe API
    return torch.optim.Adam(params, lr=1e-3)


def loss(outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    global _calls
    _calls += 1
    if RANK == DIE_RANK and _calls == DIE_AT and ONCE and not os.path.exists(str(ONCE)):
        open(str(ONCE), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if SLEEP_S:
        time.sleep(float(SLEEP_S))  # type: ignore[arg-type]
    return nn.functional.cross_entropy(outputs, batch[1])


def train_data(ctx):  # noqa: ANN001, ANN201 - the recipe API
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96 * 50, 256, generator=gen)
    return TensorDataset(x, (x[:, :10]).argmax(dim=1))
