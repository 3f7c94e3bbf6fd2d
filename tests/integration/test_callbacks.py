"""A recipe's ``callbacks()`` (issue 47): hooks every rank runs with the same figures, a stop the ranks
agree on, and ``distrun.callbacks.EarlyStopping`` with Keras's semantics.

The recipe learns ``y = 3x`` and is evaluated on ``y = -3x``: every step that learns makes the
evaluation worse, so the first evaluation is the best and EarlyStopping's count is certain."""

from __future__ import annotations

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

RISING = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset

from distrun.callbacks import Callback, EarlyStopping

defaults = {"global_batch_size": 8}
_x = torch.linspace(-1, 1, 64).unsqueeze(1)


def model():
    return nn.Linear(1, 1)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05)


def loss(outputs, batch):
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    return TensorDataset(_x, 3 * _x)


def eval_data(ctx):  # the opposite slope: each step that learns the training data makes this worse
    return TensorDataset(_x, -3 * _x)


class Seen(Callback):
    """Prints what each hook saw, on every rank."""

    def on_train_begin(self, state):
        print(f"seen begin {state.step} of {state.total_steps}", flush=True)

    def on_step_end(self, state):
        print(f"seen step {state.step} loss {state.loss!r} lr {state.lr!r}", flush=True)

    def on_eval_end(self, state):
        print(f"seen eval {state.step} {state.eval_metrics['loss']!r}", flush=True)

    def on_train_end(self, state):
        print(f"seen end {state.step}", flush=True)


def callbacks():
    return [Seen(), EarlyStopping(monitor="eval_loss", patience=2, RESTORE)]
'''


def _recipe(write_recipe, restore=False, name="rising.py"):
    return write_recipe(RISING.replace("RESTORE", f"restore_best_weights={restore}"), name)


def _seen(result):
    """rank -> the lines its Seen callback printed."""
    lines: dict[int, list[str]] = {}
    for event in result.json_lines():
        if event["type"] == "output" and event["line"].startswith("seen "):
            lines.setdefault(event["rank"], []).append(event["line"].removeprefix("seen "))
    return lines


def test_early_stopping_stops_every_rank_after_the_patience_th_evaluation_without_improvement(write_recipe, tmp_path):
    """Evaluations at steps 2, 4, 6: the first sets the best, 4 and 6 fail to improve on it, so with
    patience 2 every rank stops after step 6 (of 12), with no evaluation after it (step 6 had one),
    the last checkpoint at step 6, exit 0 and the callback named in the summary. Its count is in
    the checkpoint: resumed, the run stops at the next evaluation (step 8)."""
    result = run_cli("train", str(_recipe(write_recipe)), "--json", "-s", "mirrored", "--replicas", "2",
                     "--steps", "12", "--eval-every", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--checkpoint-every", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    events = result.json_lines()
    evals = {e["step"]: e["metrics"]["loss"] for e in events if e["type"] == "eval"}
    assert sorted(evals) == [2, 4, 6], evals
    assert evals[2] < evals[4] < evals[6], evals  # the recipe does what this test needs
    summary = result.summary
    assert (summary["status"], summary["steps"]) == ("succeeded", 6), summary
    assert summary["reason"] == (f"EarlyStopping: eval_loss did not improve for 2 evaluations "
                                 f"(best {evals[2]:.4g} at step 2)"), summary["reason"]
    assert {e["rank"]: e["steps"] for e in events if e["type"] == "done"} == {0: 6, 1: 6}
    saved = load_checkpoint(latest_checkpoint(tmp_path / "ck"))
    assert saved["step"] == 6
    # EarlyStopping's count is in the checkpoint (Seen keeps nothing), the count that stopped it too
    # (step 6's checkpoint, due by --checkpoint-every 3, is written again after its evaluation).
    assert saved["extra"]["callbacks"] == {"1": {"best": evals[2], "best_step": 2, "wait": 2}}, saved["extra"]

    seen = _seen(result)
    assert seen[0] == seen[1], seen  # every rank ran every hook with the same figures
    assert seen[0][0] == "begin 0 of 12" and seen[0][-1] == "end 6", seen[0]
    assert [line.split()[1] for line in seen[0] if line.startswith("eval")] == ["2", "4", "6"]
    steps = {int(line.split()[1]): line.split() for line in seen[0] if line.startswith("step")}
    assert sorted(steps) == list(range(1, 7))
    # The loss a hook sees is the global batch's mean: the summary's final loss, at step 6.
    assert float(steps[6][3]) == pytest.approx(summary["final_loss"], rel=1e-6)
    assert float(steps[6][5]) == pytest.approx(0.05)

    resumed = run_cli("train", str(_recipe(write_recipe)), "--json", "-s", "mirrored", "--replicas", "2",
                      "--steps", "12", "--eval-every", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.summary["steps"] == 8, resumed.summary  # the next evaluation is the third without improvement
    assert resumed.summary["reason"] == (f"EarlyStopping: eval_loss did not improve for 3 evaluations "
                                         f"(best {evals[2]:.4g} at step 2)"), resumed.summary["reason"]


@pytest.mark.parametrize("who", ["True", "os.environ['RANK'] == '1'"], ids=["every-rank", "rank-1-alone"])
def test_a_stop_on_a_step_with_no_evaluation_evaluates_and_checkpoints_that_step(write_recipe, tmp_path, who):
    """A callback stops the run in on_step_end at step 3 (evaluations every 2): every rank stops
    after step 3, the run evaluates there (as at any run's end) and writes step 3's checkpoint. Also
    where only rank 1's callback says stop: the ranks agree on it (and on its reason)."""
    recipe = write_recipe(RISING.replace("RESTORE", "restore_best_weights=False").replace(
        "return [Seen(), EarlyStopping(monitor=\"eval_loss\", patience=2, restore_best_weights=False)]",
        "return [StopAt3()]") + f'''

import os


class StopAt3(Callback):
    def on_step_end(self, state):
        if state.step == 3 and {who}:
            state.stop, state.reason = True, "enough at step 3"
''', "stop3.py")
    assert "return [StopAt3()]" in recipe.read_text()
    result = run_cli("train", str(recipe), "--json", "-s", "mirrored", "--replicas", "2", "--steps", "12",
                     "--eval-every", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    assert result.returncode == 0, result.stderr[-3000:]
    events = result.json_lines()
    assert sorted({e["step"] for e in events if e["type"] == "eval"}) == [2, 3]  # step 3's: the run's end
    assert {e["rank"]: e["steps"] for e in events if e["type"] == "done"} == {0: 3, 1: 3}
    assert (result.summary["steps"], result.summary["reason"]) == (3, "StopAt3: enough at step 3"), result.summary
    assert load_checkpoint(latest_checkpoint(tmp_path / "ck"))["step"] == 3


@pytest.mark.parametrize("flags", [(), ("-s", "sharded", "--replicas", "2")], ids=["one-device", "sharded"])
def test_early_stopping_on_each_epochs_evaluation_restores_the_best_weights(write_recipe, tmp_path, flags):
    """No --eval-every: each epoch (2 steps of 32) ends with an evaluation, at steps 2, 4, 6; the run
    stops at epoch 3 of 12, and restore_best_weights puts back step 2's weights (under sharded,
    each rank its shards): the last checkpoint holds what a run of 2 steps ends with."""
    recipe = _recipe(write_recipe, restore=True)
    best = run_cli("train", str(recipe), "--json", "-b", "32", "--steps", "2", "--checkpoint-dir", str(tmp_path / "two"))
    assert best.returncode == 0, best.stderr[-3000:]
    result = run_cli("train", str(recipe), "--json", "-b", "32", "--epochs", "12",
                     "--checkpoint-dir", str(tmp_path / "ck"), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.summary
    assert summary["steps"] == 6 and summary["reason"].startswith("EarlyStopping: eval_loss did not improve for 2 "), summary
    saved = load_checkpoint(latest_checkpoint(tmp_path / "ck"))
    assert saved["step"] == 6
    two = load_checkpoint(latest_checkpoint(tmp_path / "two"))["model"]
    for key, tensor in two.items():
        torch.testing.assert_close(saved["model"][key], tensor, rtol=0, atol=1e-6, msg=key)


def test_a_callback_that_raises_is_the_recipes_error_named_with_its_class(write_recipe):
    recipe = write_recipe(RISING.replace("RESTORE", "restore_best_weights=False") + '''

class Boom(Callback):
    def on_step_end(self, state):
        if state.step == 3:
            raise RuntimeError("no more")


def callbacks():
    return [Boom()]
''', "boom.py")
    result = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "6")
    assert result.returncode == 3, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1, result.stderr[-3000:]
    assert "callback Boom raised in on_step_end: RuntimeError: no more" in last, last
    assert "boom.py:" in last and "step 3" in last, last


@pytest.mark.parametrize(("body", "expected"), [
    ("EarlyStopping()", "callbacks() returned EarlyStopping; it must return a list of distrun.callbacks.Callback"),
    ("[EarlyStopping(), print]", "callbacks() returned a list holding a builtin_function_or_method; it must return"),
    ("[EarlyStopping(monitor='loss')]", "EarlyStopping: monitor must name an evaluation metric, eval_loss or "
                                        "eval_<metric>. Received: 'loss'"),
], ids=["not-a-list", "not-a-callback", "bad-monitor"])
def test_callbacks_that_are_not_a_list_of_callbacks_are_one_line_exit_3(write_recipe, body, expected):
    recipe = write_recipe(RISING.replace("RESTORE", "restore_best_weights=False")
                          + f"\n\ndef callbacks():\n    return {body}\n", "bad.py")
    result = run_cli("train", str(recipe), "--steps", "2")
    assert result.returncode == 3, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert expected in lines[-1] and "bad.py:" in lines[-1], lines[-3:]


@pytest.mark.parametrize(("kwargs", "values", "stops_at"), [
    ({"patience": 2}, [1.0, 0.9, 0.95, 0.91, 0.8], 3),  # the best is 0.9: 0.95 and 0.91 fail to beat it
    ({"patience": 2, "min_delta": 0.05}, [1.0, 0.96, 0.97, 0.5], 2),  # 0.96 is better, but not by 0.05
    ({"patience": 0}, [1.0, 1.0], 1),  # equal is no improvement
    ({"monitor": "eval_accuracy", "mode": "max", "patience": 1}, [0.5, 0.6, 0.6], 2),
], ids=["patience", "min-delta", "patience-0", "max"])
def test_early_stopping_counts_as_keras_does(kwargs, values, stops_at):
    """Keras's rule, without processes: ``min_delta`` is how much better an evaluation must be."""
    from distrun.callbacks import CallbackState, EarlyStopping, Progress

    stop = EarlyStopping(**kwargs)
    stop.on_train_begin(CallbackState(Progress(step=0, epoch=0)))
    key = stop.monitor.removeprefix("eval_")
    for index, value in enumerate(values):
        state = CallbackState(Progress(step=index, epoch=0, eval_metrics={key: value}))
        stop.on_eval_end(state)
        if state.stop:
            break
    assert (state.stop, index) == (True, stops_at), stop.state_dict()
