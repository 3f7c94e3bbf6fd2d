"""--compression: DDP communication hooks under mirrored, on real gloo process groups."""

import json

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV
from tests.integration.test_equivalence import train

pytestmark = pytest.mark.integration

FULL_BATCHES = ("--", "--samples", "96")  # six full batches an epoch at EQUIV's global batch 16
LR = 0.01  # EQUIV's Adam


def checkpoint(ckpt):
    return torch.load(latest_checkpoint(ckpt), weights_only=True)


def max_diff(a, b):
    return max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])


def losses(result):
    return [line["loss"] for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0]


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("none")
    recipe = ckpt / "equiv.py"
    recipe.write_text(EQUIV)
    train(recipe, ckpt / "ckpt", "mirrored", "--steps", "12", "--log-interval-s", "0", *FULL_BATCHES)
    return recipe, checkpoint(ckpt / "ckpt")


@pytest.mark.parametrize(("compression", "eps"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_a_cast_compression_stays_within_its_rounding_of_the_uncompressed_run(uncompressed, tmp_path, compression,
                                                                               eps):
    """Adam moves each parameter by about lr per step whatever the gradient's size; a gradient
    rounded to ``eps`` changes that move by at most eps of it, so 12 steps drift at most
    12 * lr * eps. A hook that sent nothing different would give a difference of zero."""
    recipe, none = uncompressed
    result = train(recipe, tmp_path / "ckpt", "mirrored", "--steps", "12", "--compression", compression,
                   "--log-interval-s", "0", *FULL_BATCHES)
    assert result.summary["compression"] == compression
    run = checkpoint(tmp_path / "ckpt")
    assert 0 < max_diff(run, none) <= 12 * LR * eps


def test_powersgd_trains_after_its_warmup_and_resumes_with_its_state(uncompressed, tmp_path):
    recipe, none = uncompressed
    args = ("--compression", "powersgd:1", "--powersgd-warmup", "3", "--log-interval-s", "0")
    straight = train(recipe, tmp_path / "straight", "mirrored", "--steps", "12", *args, *FULL_BATCHES)
    assert straight.summary["compression"] == "powersgd:1"
    run = checkpoint(tmp_path / "straight")
    assert max_diff(run, none) > 12 * LR * 2.0**-8, "rank-1 PowerSGD must change the updates"
    seen = losses(straight)
    assert seen[-1] < seen[0], seen
    comm = run["comm"]
    assert comm["kind"] == "powersgd" and comm["iter"] >= 12
    assert len(comm["errors"]) == 2 and all(len(errors) == 4 for errors in comm["errors"])  # each replica's, per parameter
    assert not torch.equal(comm["errors"][0]["0"], comm["errors"][1]["0"])  # residuals are each replica's own
    assert sorted(comm["q"]) == ["0", "2"]  # the two weights; the biases are all-reduced as they are
    # 7 steps, then 5 more in a new process: the same parameters as 12 straight, bit for bit.
    train(recipe, tmp_path / "resumed", "mirrored", "--steps", "7", "--checkpoint-every", "7", *args, *FULL_BATCHES)
    train(recipe, tmp_path / "resumed", "mirrored", "--steps", "12", "--resume", *args, *FULL_BATCHES)
    assert max_diff(checkpoint(tmp_path / "resumed"), run) == 0.0


def test_powersgd_on_a_model_of_several_buckets_trains_past_its_warmup():
    """Torch's PowerSGD hook issues its P and Q all-reduces from future callbacks; on a model
    of two DDP buckets the two ranks interleaved them differently and deadlocked at the first
    compressed step (gloo). distrun runs each bucket's exchange to its end, in bucket order."""
    from distrun.bench.compression import _RECIPE

    result = run_cli("train", str(_RECIPE), "--strategy", "mirrored", "--replicas", "2", "--json",
                     "--compression", "powersgd:2", "--powersgd-warmup", "2", "--hang-timeout-s", "60",
                     "--", "--warmup", "2", "--steps", "8", timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not [line for line in result.json_lines() if line["type"] == "hang"]
    found = [json.loads(line["line"]) for line in result.json_lines()
             if line["type"] == "output" and line["line"].startswith('{"bench"')]
    assert len(found) == 1 and found[0]["steps"] == 10
    assert found[0]["loss"] < found[0]["first_loss"]  # it learned under compression
