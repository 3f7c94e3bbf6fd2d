"""Bad recipes, failing replicas, Ctrl-C and a killed client: clear errors, nothing left behind."""

import os
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
