"""OneDeviceStrategy: no process group, same API, so recipes run undistributed."""

from __future__ import annotations

from typing import Any

from torch import nn

from distrun.strategies.base import Strategy


class OneDeviceStrategy(Strategy):
    name = "one-device"

    def _wrap(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, Any]:
        return model.to(self.device), optimizer
