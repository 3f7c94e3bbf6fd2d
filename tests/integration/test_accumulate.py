"""``--accumulate N`` (issue 47): a replica's batch in N micro-batches, one optimizer step per global
batch. An epoch's uneven last batch weighs each sample as one device does, also where a replica's
share is smaller than N (a micro-batch with no rows runs one row of weight 0, so every replica makes
the same collectives: FSDP's all-gathers would otherwise wait forever). Bad input in one line.

The schedule of test_lr_schedule.py checks the step count: stepped per micro-batch it ends elsewhere."""

from __future__ import annotations

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import run_cli
from tests.integration.test_lr_schedule import SCHEDULED

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

TOLERANCE = 2e-4  # test_model_parallel's bound against one-device


def _train(recipe, ckpt, *flags):
    result = run_cli("train", str(recipe), "--json", "--epochs", "1", "--checkpoint-dir", str(ckpt), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, load_checkpoint(latest_checkpoint(ckpt))


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("acc") / "scheduled.py"
    path.write_text(SCHEDULED)
    return path


@pytest.mark.parametrize(("batch", "flags"), [
    # 64 samples in batches of 24: the last has 16, 8 a replica, split 3 + 3 + 2.
    ("24", ("-s", "mirrored", "--replicas", "2", "--accumulate", "3")),
    # Batches of 60: the last has 4, 2 a replica, split 1 + 1 + an empty micro-batch.
    ("60", ("-s", "sharded", "--replicas", "2", "--accumulate", "3")),
], ids=["mirrored-uneven", "sharded-fewer-rows-than-micro-batches"])
def test_an_epochs_uneven_last_batch_weighs_each_sample_as_one_device_does(recipe, tmp_path, batch, flags):
    _, one = _train(recipe, tmp_path / "one", "-b", batch)
    result, data = _train(recipe, tmp_path / "acc", "-b", batch, *flags)
    assert result.summary["steps"] == -(-64 // int(batch)), result.summary  # the last batch uneven
    assert data["layout"] == {"accumulate": 3, "activation_checkpointing": "none"}  # what it was written under
    for key, tensor in one["model"].items():
        torch.testing.assert_close(data["model"][key], tensor, rtol=0, atol=TOLERANCE, msg=key)


@pytest.mark.parametrize(("flags", "atol"), [
    # A bound that bites: clipping a micro-batch's gradient, not the step's, ends elsewhere.
    (("--clip-grad-norm", "0.05"), TOLERANCE),
    # bf16 autocast: a micro-batch's rows compute as the whole batch's do; the weight gradient's sum
    # over rows is split in two, in bf16, so the bound is bf16's.
    (("--precision", "bf16"), 2e-2),
    # Compiled: each micro-batch's shapes are the whole batch's halves, compiled once for all.
    (("--compile",), TOLERANCE),
], ids=["clip-grad-norm", "precision-bf16", "compile"])
def test_accumulation_composes_with_clipping_precision_and_compile(recipe, tmp_path, flags, atol):
    # SGD: Adam's update hardly moves when every gradient is scaled alike, so a clip would not show.
    sgd = tmp_path / "sgd.py"
    sgd.write_text(recipe.read_text().replace("torch.optim.AdamW(params, lr=0.01)", "torch.optim.SGD(params, lr=0.5)"))
    assert sgd.read_text() != recipe.read_text()
    recipe = sgd
    _, one = _train(recipe, tmp_path / "one", "-b", "16", *flags)
    _, data = _train(recipe, tmp_path / "acc", "-b", "16", "-s", "mirrored", "--replicas", "2", "--accumulate", "2",
                     *flags)
    _, unclipped = _train(recipe, tmp_path / "plain", "-b", "16") if flags[0] == "--clip-grad-norm" else (None, None)
    for key, tensor in one["model"].items():
        torch.testing.assert_close(data["model"][key], tensor, rtol=0, atol=atol, msg=key)
    if unclipped is not None:  # the bound bit: without it the run ends elsewhere
        assert any((unclipped["model"][key] - tensor).abs().max() > 10 * TOLERANCE for key, tensor in one["model"].items())


def test_bad_accumulation_is_one_line_with_exit_2(recipe):
    for flags, expected in [
        (("--accumulate", "0"), "--accumulate: expected a positive whole number. Received: 0"),
        (("-s", "mirrored", "--replicas", "2", "-b", "8", "--accumulate", "3"),
         "--accumulate 3: --global-batch-size 8 does not split into 2 replica(s) x 3 micro-batches; "
         "choose a multiple of 6"),
        (("-s", "parameter-server", "--replicas", "2", "--accumulate", "2"),
         "--accumulate 2: parameter-server workers push each batch as it comes"),
    ]:
        refused = run_cli("train", str(recipe), "--steps", "2", *flags)
        assert refused.returncode == 2, (flags, refused.stderr[-2000:])
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (flags, refused.stderr)
