"""A recipe's ``scheduler(optimizer)`` (issue 47): stepped once per optimizer step under every
layout, so each ends with one-device's parameters; its state in every checkpoint, plain and
sharded, so a resume on another layout goes on where it left; ReduceLROnPlateau stepped with
the evaluation; a recipe optimizer's step hook carried through the rebuild of sharded, --tp and
--pp; bad input in one line.

The schedule changes the lr at every step, so a schedule stepped twice a step, or not at all,
or built on an optimizer the strategy does not step, ends elsewhere (and says another lr)."""

from __future__ import annotations

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV
from tests.integration.test_model_parallel import TRANSFORMER
from tests.integration.test_nonfinite import NAN_AT_5

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

TOLERANCE = 2e-4  # test_model_parallel's bound against one-device after the same steps
STEPS = 12
LR = 0.01

FACTOR = '''

def _factor(step):
    """Warm-up over 3 steps, then a decay: a different lr at every step."""
    return min(1.0, (step + 1) / 3) * 0.85 ** max(0, step - 2)
'''

SCHEDULED = TRANSFORMER + FACTOR + '''

def scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _factor)
'''

#: The same lr at every step, set by a step pre-hook on the recipe's optimizer (the issue's user
#: wrote the schedule this way): sharded, --tp and --pp rebuild the optimizer and must keep it.
HOOKED = TRANSFORMER.replace("""def optimizer(params):
    return torch.optim.AdamW(params, lr=0.01)""", """def optimizer(params):
    opt = torch.optim.AdamW(params, lr=0.01)
    taken = [0]

    def schedule(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            group["lr"] = 0.01 * _factor(taken[0])
        taken[0] += 1

    opt.register_step_pre_hook(schedule)
    return opt""") + FACTOR


def _factor(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.85 ** max(0, step - 2)


def _train(recipe, ckpt, *flags, steps=STEPS):
    result = run_cli("train", str(recipe), "--json", "--steps", str(steps), "--checkpoint-dir", str(ckpt), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, load_checkpoint(latest_checkpoint(ckpt))


def _close(a, b, what):
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))}"
    for key, tensor in b.items():
        torch.testing.assert_close(a[key], tensor, rtol=0, atol=TOLERANCE, msg=f"{what}: {key}")


def _step_lrs(result):
    """Rank 0's step events: step -> the lr it used."""
    return {line["step"]: line["lr"] for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lr")
    (folder / "scheduled.py").write_text(SCHEDULED)
    (folder / "hooked.py").write_text(HOOKED)
    return folder


@pytest.fixture(scope="module")
def one_device(recipes, tmp_path_factory):
    """The reference: 12 steps on one device with the schedule."""
    result, data = _train(recipes / "scheduled.py", tmp_path_factory.mktemp("one"))
    lrs = _step_lrs(result)
    # Step k used the lr of k - 1 scheduler steps: the schedule moves once per step, after it.
    assert lrs[1] == pytest.approx(LR * _factor(0)) and lrs[STEPS] == pytest.approx(LR * _factor(STEPS - 1)), lrs
    assert data["lr_scheduler"]["last_epoch"] == STEPS
    return result, data


@pytest.mark.parametrize("flags", [
    ("-s", "multi-worker", "--replicas", "2"),
    # DiLoCo: the recipe's optimizer is the inner one, stepped (and scheduled) every step; the outer
    # one, at each sync, is not scheduled. Its parameters are not one device's (it averages every 4).
    ("-s", "diloco", "--replicas", "2", "--sync-every", "4"),
], ids=["multi-worker", "diloco-inner"])
def test_the_schedule_steps_once_a_step_under_multi_worker_and_diloco(recipes, one_device, tmp_path, flags):
    reference, one = one_device
    result, data = _train(recipes / "scheduled.py", tmp_path / "ck", *flags)
    lrs = _step_lrs(result)
    assert all(lr == pytest.approx(LR * _factor(step - 1)) for step, lr in lrs.items()), lrs
    assert lrs[STEPS] == pytest.approx(LR * _factor(STEPS - 1)) and data["lr_scheduler"]["last_epoch"] == STEPS
    if "multi-worker" in flags:
        _close(data["model"], one["model"], "multi-worker vs one-device")


@pytest.mark.parametrize("flags", [
    ("-s", "mirrored", "--replicas", "2", "--accumulate", "2"),
    ("-s", "sharded", "--replicas", "2", "--accumulate", "2"),
    ("-s", "central-storage", "--replicas", "2", "--accumulate", "4"),
    ("-s", "mirrored", "--tp", "2", "--accumulate", "4"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "1f1b", "--accumulate", "2"),
    ("-s", "parameter-server", "--replicas", "1", "--ps-sync"),
], ids=["mirrored-acc2", "sharded-acc2", "central-storage-acc4", "tp-acc4", "pp-acc2", "ps"])
def test_a_schedule_ends_with_one_devices_parameters(recipes, one_device, tmp_path, flags):
    """With --accumulate, at the same global batch of 8 with no accumulation on one device: the
    optimizer and the schedule step once per global batch, not once per micro-batch."""
    reference, one = one_device
    result, data = _train(recipes / "scheduled.py", tmp_path / "ck", *flags)
    _close(data["model"], one["model"], f"{' '.join(flags)} vs one-device")
    assert _step_lrs(result)[STEPS] == pytest.approx(LR * _factor(STEPS - 1))
    assert data["lr_scheduler"]["last_epoch"] == STEPS, data["lr_scheduler"]
    assert result.summary["final_loss"] == pytest.approx(reference.summary["final_loss"], abs=TOLERANCE)
    if "--accumulate" in flags:
        parts = int(flags[flags.index("--accumulate") + 1])
        replicas = int(flags[flags.index("--replicas") + 1]) if "--replicas" in flags else 1
        assert (result.summary["micro_batch_size"], result.summary["accumulate"]) == (8 // replicas // parts, parts)


@pytest.mark.parametrize("flags", [
    ("-s", "sharded", "--replicas", "2"),
    ("-s", "mirrored", "--tp", "2"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "1f1b"),
], ids=["sharded", "tp", "pp"])
def test_a_resume_on_another_layout_goes_on_with_the_schedule(recipes, one_device, tmp_path, flags):
    """Stopped at step 6 of 12 under sharded x2, --tp 2 or --pp 2 (the schedule's state in the
    sharded checkpoint's JSON), resumed on one device: where the uninterrupted run ends."""
    _, one = one_device
    ckpt = tmp_path / "ck"
    _train(recipes / "scheduled.py", ckpt, *flags, steps=6)
    result, data = _train(recipes / "scheduled.py", ckpt, "--resume")
    _close(data["model"], one["model"], f"{' '.join(flags)} to step 6, one-device to 12, vs one-device")
    lrs = _step_lrs(result)
    assert min(lrs) == 7 and lrs[7] == pytest.approx(LR * _factor(6)), lrs
    assert data["lr_scheduler"]["last_epoch"] == STEPS


@pytest.mark.parametrize("flags", [
    ("-s", "sharded", "--replicas", "2"),
    ("-s", "mirrored", "--tp", "2"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "1f1b"),
], ids=["sharded", "tp", "pp"])
def test_a_resume_into_a_split_layout_goes_on_with_the_schedule(recipes, one_device, tmp_path, flags):
    """The other way: one device to step 6 (a plain checkpoint), resumed under sharded x2, --tp 2
    or --pp 2, whose rebuilt optimizers (one per stage under --pp) take the schedule's lr, not the
    one the loaded optimizer state carries."""
    _, one = one_device
    ckpt = tmp_path / "ck"
    _train(recipes / "scheduled.py", ckpt, steps=6)
    result, data = _train(recipes / "scheduled.py", ckpt, "--resume", *flags)
    _close(data["model"], one["model"], f"one-device to step 6, {' '.join(flags)} to 12, vs one-device")
    lrs = _step_lrs(result)
    assert min(lrs) == 7 and lrs[7] == pytest.approx(LR * _factor(6)) and lrs[STEPS] == pytest.approx(
        LR * _factor(STEPS - 1)), lrs
    assert data["lr_scheduler"]["last_epoch"] == STEPS


@pytest.mark.parametrize("flags", [
    ("-s", "sharded", "--replicas", "2"),
    ("-s", "mirrored", "--tp", "2"),
    ("-s", "mirrored", "--pp", "2", "--pp-schedule", "1f1b"),
], ids=["sharded", "tp", "pp"])
def test_an_optimizers_step_hook_survives_the_rebuild(recipes, one_device, tmp_path, flags):
    """The hook sets the schedule's lr before each step: one-device's scheduled parameters."""
    _, one = one_device
    result, data = _train(recipes / "hooked.py", tmp_path / "ck", *flags)
    _close(data["model"], one["model"], f"hooked {' '.join(flags)} vs one-device with scheduler()")
    assert _step_lrs(result)[STEPS] == pytest.approx(LR * _factor(STEPS - 1))


def test_under_parameter_server_each_worker_schedules_its_own_pushes(recipes, tmp_path):
    """Two asynchronous workers: each one's schedule moves once per push of its own, so the lr a
    push carries is the schedule at that worker's push count, whatever the global step."""
    result, _ = _train(recipes / "scheduled.py", tmp_path / "ck", "-s", "parameter-server", "--replicas", "2",
                       "--log-interval-s", "0")
    steps = [line for line in result.json_lines() if line["type"] == "step"]
    by_worker = {rank: [line["pushes"] for line in steps if line["rank"] == rank] for rank in (0, 1)}
    assert all(by_worker.values()) and sum(max(p) for p in by_worker.values()) >= STEPS, by_worker
    for line in steps:
        assert line["lr"] == pytest.approx(LR * _factor(line["pushes"] - 1)), line
    # Interleaved: some step's lr is not the one the global step count would give.
    assert any(line["lr"] != pytest.approx(LR * _factor(line["step"] - 1)) for line in steps), steps


PLATEAU = TRANSFORMER + '''

def scheduler(optimizer):
    # Nothing is ever better by 10: every evaluation after the first halves the lr.
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=10,
                                                      threshold_mode="abs")
'''


def test_reduce_on_plateau_steps_with_each_evaluation_and_bad_input_is_one_line(write_recipe, tmp_path):
    """Evaluations at steps 2, 4 and 6: the first sets the best, the next two halve the lr (after
    step 4 and after step 6), whatever the steps did."""
    result, data = _train(write_recipe(PLATEAU), tmp_path / "ck", "--eval-every", "2", steps=6)
    lrs = _step_lrs(result)
    assert lrs[1] == pytest.approx(LR) and lrs[6] == pytest.approx(LR / 2), lrs
    assert data["lr_scheduler"]["_last_lr"] == [pytest.approx(LR / 4)], data["lr_scheduler"]
    assert data["optimizer"]["param_groups"][0]["lr"] == pytest.approx(LR / 4)

    not_one = write_recipe(TRANSFORMER + "\n\ndef scheduler(optimizer):\n    return optimizer\n", "not_one.py")
    refused = run_cli("train", str(not_one), "--steps", "2")
    assert refused.returncode == 3, refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert "Traceback" not in refused.stderr and refused.stderr.count("error:") == 1, refused.stderr[-2000:]
    assert "scheduler() returned AdamW; it must return a torch.optim.lr_scheduler.LRScheduler" in last, last
    assert "not_one.py" in last, last


#: The plateau watches accuracy (growing is better), not the loss: a strict rise of accuracy keeps
#: the lr, anything else halves it.
ON_ACCURACY = EQUIV + """

scheduler_monitor = "eval_accuracy"


def scheduler(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0,
                                                      threshold=0.0, threshold_mode="abs")
"""


def _replayed_lr(values: list[float]) -> float:
    """The lr ReduceLROnPlateau(mode="max", patience=0) ends at after these evaluations, from EQUIV's 0.01."""
    param = torch.nn.Parameter(torch.zeros(1))
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.Adam([param], lr=0.01), mode="max", factor=0.5,
                                                         patience=0, threshold=0.0, threshold_mode="abs")
    for value in values:
        plateau.step(value)
    return plateau.get_last_lr()[0]


def test_reduce_on_plateau_watches_the_recipes_scheduler_monitor(write_recipe, tmp_path):
    """`scheduler_monitor = "eval_accuracy"`: each evaluation's accuracy, as every rank reduced it,
    steps the plateau; the same evaluations' losses would end at another lr."""
    result, data = _train(write_recipe(ON_ACCURACY), tmp_path / "ck", "-s", "mirrored", "--replicas", "2",
                          "--eval-every", "2", "--", "--samples", "160", steps=20)
    evals = [e["metrics"] for e in result.json_lines() if e["type"] == "eval"]
    assert len(evals) == 10, evals
    on_accuracy = _replayed_lr([e["accuracy"] for e in evals])
    assert on_accuracy != pytest.approx(_replayed_lr([e["loss"] for e in evals])), evals  # the test can tell
    assert data["optimizer"]["param_groups"][0]["lr"] == pytest.approx(on_accuracy), (evals, data["lr_scheduler"])


def test_a_skipped_update_does_not_move_the_schedule(write_recipe, tmp_path):
    """--on-nonfinite skip drops step 5's update on every replica: the schedule moves 11 times in
    12 steps, as the fp16 scaler's skipped steps do not move it either (they never reach the
    optimizer's step)."""
    recipe = write_recipe(NAN_AT_5 + "\n\ndef scheduler(optimizer):\n"
                          "    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)\n")
    result, data = _train(recipe, tmp_path / "ck", "-s", "mirrored", "--replicas", "2", "--on-nonfinite", "skip")
    assert data["lr_scheduler"]["last_epoch"] == 11, data["lr_scheduler"]
    assert data["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05 * 0.9 ** 11)
    lrs = _step_lrs(result)
    assert lrs[12] == pytest.approx(0.05 * 0.9 ** 10), lrs  # step 12 used the lr of 10 applied updates
