"""Bad recipes, failing replicas, Ctrl-C and a killed client: clear errors, nothing left behind."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, assert_no_processes, run_cli, training_processes
from tests.integration._recipes import RAISES_IN_RANK_1, SLOW

pytestmark = pytest.mark.integration


def test_syntax_error_names_file_and_line_without_a_traceback(write_recipe):
    recipe = write_recipe("import torch\n\ndef model(:\n    pass\n")
    result = run_cli("train", str(recipe), "-s", "mirrored")
    assert result.returncode == 3
    assert result.stderr.strip() == f"error: {recipe}:3: syntax error: invalid syntax"


def test_missing_function_is_named(write_recipe):
    recipe = write_recipe("def model():\n    pass\n\ndef optimizer(p):\n    pass\n")
    result = run_cli("train", str(recipe))
    assert result.returncode == 3
    assert "lacks loss(outputs, batch), train_data(ctx)" in result.stderr
    assert "Traceback" not in result.stderr


def test_import_time_failure_is_a_recipe_error(write_recipe):
    recipe = write_recipe("import torch\nimport no_such_module_xyz\n\ndef main(strategy):\n    pass\n")
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2")
    assert result.returncode == 3
    assert f"{recipe}:2:" in result.stderr and "No module named 'no_such_module_xyz'" in result.stderr
    assert_no_processes(str(recipe.parent))


def test_a_rank_raising_at_step_k_stops_every_replica(write_recipe):
    recipe = write_recipe(RAISES_IN_RANK_1)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "1000")
    assert result.returncode == 4
    last = result.stderr.strip().splitlines()[-1]
    line = next(i for i, text in enumerate(RAISES_IN_RANK_1.splitlines(), 1) if "raise ValueError" in text)
    assert last == f"error: {recipe}:{line}: rank 1 failed at step 3: ValueError: boom at step 3"
    assert "Traceback" not in result.stderr
    assert result.wall_s < 60
    assert_no_processes(str(recipe.parent))


FIT = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def model():
    return {model}

def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)

def loss(outputs, batch):
    return nn.functional.mse_loss(outputs, batch[1], reduction={reduction!r})

def train_data(ctx):
    return TensorDataset(torch.randn(64, 2), torch.randn(64, 1))
"""


def test_a_model_that_cannot_be_built_fails_while_building_not_at_a_step(write_recipe):
    recipe = write_recipe(FIT.format(model="nn.Linear(2, undefined_width)", reduction="mean"))
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "5")
    assert result.returncode == 4, result.stderr
    line = next(i for i, text in enumerate(FIT.splitlines(), 1) if "return {model}" in text)
    assert re.fullmatch(rf"error: {re.escape(str(recipe))}:{line}: rank [01] failed while building the model: "
                        r"NameError: name 'undefined_width' is not defined", result.stderr.strip().splitlines()[-1])


def test_a_loss_that_is_not_one_number_names_the_recipes_loss(write_recipe):
    recipe = write_recipe(FIT.format(model="nn.Linear(2, 1)", reduction="none"))
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "5")
    assert result.returncode == 3, result.stderr
    line = next(i for i, text in enumerate(FIT.splitlines(), 1) if text.startswith("def loss("))
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(rf"error: {re.escape(str(recipe))}:{line}: rank [01] failed at step 1: loss\(\) returned a tensor "
                    r"of shape \(32, 1\); it must return one number", last), last
    assert "reduction='mean'" in last and "implicitly created" not in result.stderr


def test_debug_shows_the_traceback(write_recipe):
    recipe = write_recipe(RAISES_IN_RANK_1)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "20", "--debug")
    assert result.returncode == 4
    assert "Traceback (most recent call last)" in result.stderr
    assert 'raise ValueError("boom at step 3")' in result.stderr


def test_json_failure_ends_with_a_failed_summary(write_recipe):
    recipe = write_recipe(RAISES_IN_RANK_1)
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "20", "--json")
    assert result.returncode == 4
    summary = result.summary
    assert summary["status"] == "failed" and "rank 1 failed at step 3" in summary["error"]
    errors = [e for e in result.json_lines() if e["type"] == "error"]
    assert errors and errors[0]["rank"] == 1


def _start(recipe, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "distrun", "train", str(recipe), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_for_training(marker, count, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while len(training_processes(marker)) < count:
        assert time.monotonic() < deadline, "training processes did not start"
        time.sleep(0.2)
    time.sleep(3)  # past start-up, inside the training loop


def test_ctrl_c_stops_all_replicas_and_exits_130(write_recipe):
    recipe = write_recipe(SLOW)
    proc = _start(recipe, "-s", "mirrored", "--replicas", "2", "--epochs", "50")
    _wait_for_training(str(recipe.parent), 2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted")
    assert_no_processes(str(recipe.parent))


def test_a_sigkilled_client_leaves_no_training_process(write_recipe):
    recipe = write_recipe(SLOW)
    proc = _start(recipe, "-s", "mirrored", "--replicas", "2", "--epochs", "50")
    _wait_for_training(str(recipe.parent), 2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert_no_processes(str(recipe.parent), within_s=10)


def test_sigint_stops_a_job_started_in_the_background_with_sigint_ignored(write_recipe):
    """`setsid distrun train ... &` from a script: no terminal, and SIGINT arrives ignored
    (a shell's background job). `kill -INT` must still stop the job as Ctrl-C does."""
    recipe = write_recipe(SLOW)

    def background() -> None:
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "-s", "mirrored", "--replicas", "2",
                             "--epochs", "50", "--json"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, preexec_fn=background)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # into the training loop: a step has been reported
        seen.append(line)
        if line.startswith('{"type":"step"'):
            break
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    out = "".join(seen) + out
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("error: interrupted")
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["type"] == "summary" and summary["status"] == "interrupted"
    # What it trained before the stop, as the live table last showed it (not "-" and 0.0).
    assert summary["steps"] > 0 and summary["final_loss"] is not None and summary["samples_per_s"] > 0, summary
    assert summary["world_size"] == 2
    assert_no_processes(str(recipe.parent))
