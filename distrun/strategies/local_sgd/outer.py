"""The global weights and their outer optimizer: what every DiLoCo replica agrees on at each sync.

They live in host memory, in fp32, whatever the device and precision the replicas train at
(the paper's setup: the outer state costs no accelerator memory). A sync of a fragment hands
this the replicas' mean pseudo-gradient (global minus local) for the fragment's tensors; the
outer optimizer steps them as if it were their gradient. torch's SGD skips a tensor without a
gradient, so one optimizer serves every fragment, each momentum buffer its own tensor's.
"""

from __future__ import annotations

from typing import Any

import torch

from distrun.strategies.elastic.heal import broadcast_tensors

__all__ = ["GlobalWeights"]


class GlobalWeights:
    """fp32 host copies of ``params`` and the SGD (Nesterov unless ``momentum`` is 0) that steps them."""

    def __init__(self, params: list[torch.nn.Parameter], *, lr: float, momentum: float) -> None:
        self.tensors = [p.detach().to("cpu", torch.float32, copy=True).requires_grad_(True) for p in params]
        # torch's SGD refuses Nesterov without momentum: --outer-momentum 0 is plain SGD.
        self.optimizer = torch.optim.SGD(self.tensors, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.outer_steps = 0  # syncs of the whole model (under --fragments: of its last fragment)

    def pseudo_gradient(self, indices: list[int], params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """Global minus local for the tensors at ``indices``, fp32 on the host."""
        with torch.no_grad():
            return [self.tensors[i].detach() - params[i].detach().to("cpu", torch.float32) for i in indices]

    def step(self, indices: list[int], mean: list[torch.Tensor]) -> None:
        """Apply the replicas' mean pseudo-gradient to the tensors at ``indices``."""
        for i, value in zip(indices, mean):
            self.tensors[i].grad = value.to("cpu", torch.float32)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def copy_into(self, indices: list[int], params: list[torch.nn.Parameter], *, keep_local: float = 0.0) -> None:
        """Set the parameters at ``indices`` to the global weights; ``keep_local`` in [0, 1) mixes
        in the replica's own (streaming DiLoCo's alpha: the inner steps taken while the fragment's
        exchange was on the wire)."""
        with torch.no_grad():
            for i in indices:
                value = self.tensors[i].detach().to(params[i].device, params[i].dtype)
                if keep_local:
                    params[i].mul_(keep_local).add_(value, alpha=1.0 - keep_local)
                else:
                    params[i].copy_(value)

    def load(self, params: list[torch.nn.Parameter]) -> None:
        """Take the parameters' values as the global weights (after a restore)."""
        with torch.no_grad():
            for tensor, p in zip(self.tensors, params):
                tensor.copy_(p.detach().to("cpu", torch.float32))

    def broadcast(self, source: int, device: torch.device) -> None:
        """Make the global weights and the outer momentum ``source``'s (over the current group):
        a member healed after a change of membership. A member that has stepped no outer step
        yet holds no momentum buffer; a zero one steps the same (SGD's first buffer is the
        gradient, and 0 x momentum + gradient is that)."""
        tensors = [t.detach() for t in self.tensors]
        if self.optimizer.defaults["momentum"] > 0:
            for tensor in self.tensors:
                state = self.optimizer.state[tensor]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(tensor.detach())
                tensors.append(state["momentum_buffer"])
        broadcast_tensors(tensors, source, device)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict[str, Any], *, lr: float, momentum: float) -> None:
        """The saved momentum and count; the learning rate and momentum are this job's flags
        (torch's load would bring back the saved run's)."""
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group.update(lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.outer_steps = int(state.get("outer_steps", 0))
