"""A checkpoint of another model: one line with the first keys and shapes that differ, from torch's own error."""

from __future__ import annotations

import torch
from torch import nn

from distrun.strategies.checkpoint.mismatch import describe_mismatch


def _error(model: nn.Module, state: dict) -> RuntimeError:
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        return exc
    raise AssertionError("load_state_dict accepted another model's state")


def test_sizes_missing_and_unexpected_keys_are_named_three_at_most() -> None:
    saved = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).state_dict()
    wider = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    assert describe_mismatch(_error(wider, saved)) == (
        "size mismatch for 0.weight (checkpoint [16, 6], model [8, 6]), 0.bias (checkpoint [16], model [8]), "
        "2.weight (checkpoint [3, 16], model [3, 8])")
    other = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3), nn.Linear(3, 1))
    assert describe_mismatch(_error(other, saved)) == "missing keys: 3.weight, 3.bias"
    many = {f"layer{i}.weight": torch.zeros(1) for i in range(5)}
    assert describe_mismatch(_error(nn.Linear(1, 1), many)) == (
        "missing keys: weight, bias; unexpected keys: layer0.weight, layer1.weight, layer2.weight and 2 more")


def test_another_error_is_not_described() -> None:
    assert describe_mismatch(RuntimeError("CUDA out of memory")) is None
