"""Unmodified Lightning and Accelerate scripts under distrun: a live view and a filled summary.

The scripts (tests/integration/scripts/) are written as their libraries' docs write them:
nothing in them knows distrun. Lightning must find torchrun's environment
(TorchElasticEnvironment); steps come from torch's optimizer step hook, the loss from the
last ``backward()``, samples from the DataLoaders (runtime/_script_progress.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_no_processes, run_cli

pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).parent / "scripts"


def _run(script: str) -> tuple[list[dict], dict]:
    result = run_cli("train", str(SCRIPTS / script), "--strategy", "mirrored", "--replicas", "2", "--json",
                     "--log-interval-s", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.json_lines(), result.summary


def _check_progress(lines: list[dict], summary: dict, steps: int, batch: int) -> None:
    for rank in (0, 1):
        seen = [line["step"] for line in lines if line["type"] == "step" and line["rank"] == rank]
        assert seen == list(range(1, steps + 1)), seen  # one step event per optimizer step
        losses = [line["loss"] for line in lines if line["type"] == "step" and line["rank"] == rank]
        assert all(isinstance(loss, float) for loss in losses)
    assert summary["steps"] == steps
    assert summary["final_loss"] is not None and summary["final_loss"] > 0
    assert summary["samples_per_s"] > 0 and summary["time_to_first_step_s"] > 0
    done = next(line for line in lines if line["type"] == "done" and line["rank"] == 0)
    # samples/s: each rank's DataLoader yields `batch` samples a step, on two ranks, over the
    # steps after the first. Counting batches, or one rank only, would be 16x or 2x off.
    expected = 2 * batch * (steps - 1) / (done["time"] - done["first_step_time"])
    assert 0.5 * expected < summary["samples_per_s"] < 2.5 * expected, (summary["samples_per_s"], expected)


def test_a_lightning_script_gets_steps_loss_and_samples(tmp_path):
    lines, summary = _run("lightning_script.py")
    envs = {line["line"] for line in lines if line["type"] == "output" and line["line"].startswith("ENV ")}
    assert envs == {"ENV TorchElasticEnvironment 2"}  # Lightning sees torchrun's contract
    _check_progress(lines, summary, steps=20, batch=16)
    assert_no_processes(str(SCRIPTS / "lightning_script.py"))


def test_an_accelerate_script_gets_steps_loss_and_samples(tmp_path):
    lines, summary = _run("accelerate_script.py")
    said = sorted(line["line"] for line in lines if line["type"] == "output" and line["line"].startswith("ACC "))
    assert said == ["ACC 2 0", "ACC 2 1"]  # Accelerate found both processes from the environment
    _check_progress(lines, summary, steps=10, batch=16)
