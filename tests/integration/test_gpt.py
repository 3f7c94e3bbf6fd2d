"""recipes/gpt.py: a byte-level transformer on the Shakespeare that ships with the repo, under
every synchronous strategy, with tokens/s in the summary and --data-workers feeding it."""

from __future__ import annotations

import math

import pytest

from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]


GPT = str(REPO / "recipes" / "gpt.py")
SMALL = ("--", "--layers", "2", "--width", "32", "--heads", "2", "--context", "32", "--lr", "3e-3")


def _train(strategy, *flags):
    more = [] if strategy == "one-device" else ["--replicas", "2"]
    result = run_cli("train", GPT, "-s", strategy, *more, "--steps", "16", "--global-batch-size", "16", "--json",
                     *flags, *SMALL)
    assert result.returncode == 0, f"{strategy}: {result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def one_device():
    return _train("one-device")


def test_the_loss_falls_and_tokens_per_s_is_samples_per_s_times_the_context(one_device):
    steps = [line for line in one_device.json_lines() if line["type"] == "step"]
    summary = one_device.summary
    assert steps[0]["loss"] > 5.0  # about ln(256): a byte drawn at random
    assert summary["final_loss"] < steps[0]["loss"] - 1.0, (steps[0]["loss"], summary["final_loss"])
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32)
    assert summary["mfu"] is None  # a CPU: no peak to measure against
    workload = next(line for line in one_device.json_lines() if line["type"] == "workload")
    assert workload["tokens_per_sample"] == 32 and workload["flops_per_token"] > 6 * 2 * 12 * 32 * 32


def test_its_learning_rate_warms_up_then_follows_a_cosine(one_device):
    """recipes/gpt.py's schedule as the step events say it (--lr 3e-3 here): (step+1)/10 of it for
    10 warm-up steps, then a cosine toward a tenth of it at --decay-steps 200."""
    said = {line["step"]: line["lr"] for line in one_device.json_lines() if line["type"] == "step"}
    assert said[1] == pytest.approx(3e-4) and len(said) >= 2, said  # the first step's lr: step 0's factor

    def expected(step):  # the lr the optimizer used at this (1-based) step
        done = step - 1
        if done < 10:
            return 3e-3 * (done + 1) / 10
        return 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (done - 10) / 190)))

    for step, lr in said.items():
        assert lr == pytest.approx(expected(step)), (step, lr, expected(step))
    assert max(said) == 16 and said[16] < 3e-3, said  # past the warm-up: decaying


@pytest.mark.parametrize("strategy", ["mirrored", "central-storage", "sharded"])
def test_every_synchronous_strategy_trains_it_as_one_device_does(one_device, strategy):
    result = _train(strategy)
    assert result.summary["final_loss"] == pytest.approx(one_device.summary["final_loss"], rel=1e-4)


def test_it_trains_under_tensor_and_sequence_parallel_as_one_device_does(one_device):
    """Its tp_plan splits attention by heads and the MLP, its norms are marked "sequence", and its
    forward reads the length off q's output: under `--tp 2 --sequence-parallel` (4 ranks) the loss
    is one-device's."""
    result = _train("mirrored", "--tp", "2", "--sequence-parallel")
    assert result.summary["mesh"] == {"dp": 2, "tp": 2, "pp": 1}
    assert result.summary["final_loss"] == pytest.approx(one_device.summary["final_loss"], rel=1e-3)


def test_data_workers_read_the_same_batches(one_device):
    result = _train("one-device", "--data-workers", "2")
    assert result.summary["final_loss"] == pytest.approx(one_device.summary["final_loss"], rel=1e-6)


def test_data_workers_for_an_iterable_train_data_is_refused_in_one_line(write_recipe):
    recipe = write_recipe("""
import torch
from torch import nn

def model():
    return nn.Linear(2, 1)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)

def loss(outputs, batch):
    return (outputs - batch[1]).pow(2).mean()

def train_data(ctx):
    return [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
""")
    result = run_cli("train", str(recipe), "--data-workers", "2")
    assert result.returncode == 3, result.stderr[-2000:]  # RecipeError: the recipe breaks the contract
    assert "--data-workers 2:" in result.stderr and "train_data is an iterable" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
