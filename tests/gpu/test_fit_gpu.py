"""Issue 47's fit loop on CUDA: the schedule stepped once a global batch with --accumulate under
mirrored (DDP's no_sync) and sharded (FSDP2's set_requires_gradient_sync), composed with bf16
autocast and --compile, and `distrun predict` on the GPU, each against the same run on one CUDA
device (tests/integration pins the CPU behaviour). One GPU: one replica, so the NCCL paths
(2+ ranks) stay unrun here."""

from __future__ import annotations

import runpy

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import run_cli
from tests.integration.test_lr_schedule import LR, SCHEDULED, _factor
from tests.integration.test_predict import recipe_of

pytestmark = pytest.mark.gpu

STEPS = 12
#: test_model_parallel's bound on CPU; cuBLAS sums in another order, within the same bound.
TOLERANCE = 2e-4


def _train(recipe, ckpt, *flags):
    result = run_cli("train", str(recipe), "--json", "--device", "cuda", "--steps", str(STEPS), "-b", "16",
                     "--checkpoint-dir", str(ckpt), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    started = [line for line in result.json_lines() if line["type"] == "started"]
    assert started and all(line["device"].startswith("cuda") for line in started), started
    return result, load_checkpoint(latest_checkpoint(ckpt))


def _lrs(result) -> dict[int, float]:
    return {line["step"]: line["lr"] for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0}


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "scheduled.py"
    path.write_text(SCHEDULED)
    return path


@pytest.mark.parametrize(("flags", "atol"), [
    (("-s", "mirrored", "--replicas", "1", "--accumulate", "2"), TOLERANCE),
    (("-s", "sharded", "--replicas", "1", "--accumulate", "4"), TOLERANCE),
    (("-s", "mirrored", "--replicas", "1", "--accumulate", "2", "--compile"), TOLERANCE),
    # bf16 on both sides: a micro-batch's weight-gradient sum is split in two, in bf16.
    (("-s", "mirrored", "--replicas", "1", "--accumulate", "2", "--precision", "bf16"), 2e-2),
], ids=["mirrored-acc2", "sharded-acc4", "compile-acc2", "bf16-acc2"])
def test_a_schedule_with_accumulation_on_cuda_ends_with_one_devices_parameters(scheduled, tmp_path, flags, atol):
    same = ("--precision", "bf16") if "bf16" in flags else ()
    _, one = _train(scheduled, tmp_path / "one", *same)
    result, data = _train(scheduled, tmp_path / "acc", *flags)
    lrs = _lrs(result)
    assert lrs[1] == pytest.approx(LR * _factor(0)) and lrs[STEPS] == pytest.approx(LR * _factor(STEPS - 1)), lrs
    assert data["lr_scheduler"]["last_epoch"] == STEPS, data["lr_scheduler"]
    parts = int(flags[flags.index("--accumulate") + 1])
    assert (result.summary["micro_batch_size"], result.summary["accumulate"]) == (16 // parts, parts)
    for key, tensor in one["model"].items():
        torch.testing.assert_close(data["model"][key], tensor, rtol=0, atol=atol, msg=f"{' '.join(flags)}: {key}")


def test_predict_on_cuda_is_the_checkpoints_model_applied_in_order(tmp_path):
    recipe = tmp_path / "predict.py"
    recipe.write_text(recipe_of(37))
    trained = run_cli("train", str(recipe), "--device", "cuda", "--steps", "3", "--checkpoint-dir",
                      str(tmp_path / "ck"), "--json")
    assert trained.returncode == 0, trained.stderr[-3000:]
    result = run_cli("predict", str(recipe), "--device", "cuda", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--output", str(tmp_path / "out.pt"), "--json", "-b", "16")
    assert result.returncode == 0, result.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    module = runpy.run_path(str(recipe))
    model = module["model"]()
    model.load_state_dict(load_checkpoint(latest_checkpoint(tmp_path / "ck"), model_only=True)["model"])
    data = module["predict_data"](None)
    with torch.no_grad():
        want = model.eval()(torch.stack([data[i][0] for i in range(len(data))]))
    assert got["outputs"].device.type == "cpu" and got["outputs"].shape == want.shape == (37, 3)
    torch.testing.assert_close(got["outputs"], want, rtol=1e-4, atol=1e-5)
