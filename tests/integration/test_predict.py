"""`distrun predict`: a checkpoint's model over predict_data on every replica, rows in the dataset's order.

Each case trains with --checkpoint-dir, then loads the checkpoint's state dict into the recipe's
model here, in one process, and applies it to predict_data in order: the file must hold the same
rows, none missing, none twice, none padded, whatever the replicas and the strategy's layout.
"""

import runpy

import pytest
import torch

from distrun.strategies import latest_checkpoint, list_checkpoints, load_checkpoint
from tests.conftest import run_cli
from tests.integration._recipes import EQUIV

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

PREDICT = EQUIV + '''

def predict_data(ctx):
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(SAMPLES_TO_PREDICT, 6, generator=gen))
'''


def recipe_of(samples, source=None):
    """The recipe's source with predict_data of ``samples`` rows."""
    return (source or PREDICT) + f"\nSAMPLES_TO_PREDICT = {samples}\n"
#: predict_step replaces the forward: probabilities, not logits.
SOFTMAX = '''

def predict_step(model, batch):
    return torch.softmax(model(batch[0]), dim=1)
'''


def train(recipe, folder, strategy, *extra):
    result = run_cli("train", str(recipe), "-s", strategy, "--replicas", "2", "--steps", "3", "--json",
                     "--checkpoint-dir", str(folder), *extra)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A plain checkpoint folder (mirrored: steps 2 and 3) and a sharded one (sharded's ckpt-<step>/)."""
    root = tmp_path_factory.mktemp("predict")
    (root / "recipe.py").write_text(recipe_of(8))
    train(root / "recipe.py", root / "plain", "mirrored", "--checkpoint-every", "2")
    train(root / "recipe.py", root / "sharded", "sharded")
    assert [step for step, _ in list_checkpoints(root / "plain")] == [2, 3]
    assert latest_checkpoint(root / "sharded").is_dir(), "sharded wrote a plain file: this test needs its folders"
    return root


def expected(recipe, checkpoint):
    """The checkpoint's model applied here, in one process, to predict_data in order."""
    module = runpy.run_path(str(recipe))
    model = module["model"]()
    model.load_state_dict(load_checkpoint(checkpoint, model_only=True)["model"])
    model.eval()
    data = module["predict_data"](None)
    step = module.get("predict_step", lambda m, batch: m(batch[0]))
    with torch.no_grad():
        return step(model, (torch.stack([data[i][0] for i in range(len(data))]),))


def predict(recipe, output, *flags):
    result = run_cli("predict", str(recipe), "--output", str(output), "--json", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.summary["status"] == "succeeded"
    return torch.load(output, weights_only=True)


# 37 rows over 2 replicas: shares of 19 and 18. 9 rows at -b 8 under sharded: 5 and 4, in 2 batches and
# 1, so one replica runs a forward it throws away to keep FSDP's all-gathers in step.
@pytest.mark.parametrize("strategy, samples, batch, step_fn", [
    ("mirrored", 36, "16", ""), ("mirrored", 37, "16", SOFTMAX), ("sharded", 9, "8", ""),
], ids=["mirrored-even", "mirrored-uneven-predict_step", "sharded-uneven-batches"])
def test_outputs_are_the_checkpoints_model_applied_in_order(checkpoints, write_recipe, tmp_path, strategy, samples,
                                                           batch, step_fn):
    recipe = write_recipe(recipe_of(samples) + step_fn)
    folder = checkpoints / ("sharded" if strategy == "sharded" else "plain")
    got = predict(recipe, tmp_path / "out.pt", "-s", strategy, "--replicas", "2", "-b", batch,
                  "--checkpoint-dir", str(folder))
    newest = latest_checkpoint(folder)
    assert got["checkpoint"] == str(newest)
    want = expected(recipe, newest)
    assert got["outputs"].shape == want.shape == (samples, 3)
    torch.testing.assert_close(got["outputs"], want, rtol=1e-5, atol=1e-6)
    if step_fn:
        torch.testing.assert_close(got["outputs"].sum(dim=1), torch.ones(samples))


def test_an_older_checkpoint_by_path_and_a_plain_one_under_sharded(checkpoints, write_recipe, tmp_path):
    recipe = write_recipe(recipe_of(11))
    older = dict(list_checkpoints(checkpoints / "plain"))[2]
    got = predict(recipe, tmp_path / "out.pt", "-s", "sharded", "--replicas", "2", "--checkpoint", str(older))
    assert got["checkpoint"] == str(older)
    want = expected(recipe, older)
    torch.testing.assert_close(got["outputs"], want, rtol=1e-5, atol=1e-6)
    newer = expected(recipe, latest_checkpoint(checkpoints / "plain"))
    assert not torch.allclose(want, newer), "steps 2 and 3 predict alike: the test cannot tell them apart"


@pytest.mark.parametrize("split", [("--tp", "2"), ("--pp", "2")], ids=["tp", "pp"])
def test_a_replica_split_over_ranks_predicts_each_row_once(checkpoints, write_recipe, tmp_path, split):
    recipe = write_recipe(recipe_of(13))
    got = predict(recipe, tmp_path / "out.pt", "-s", "mirrored", "--replicas", "1", *split,
                  "--checkpoint-dir", str(checkpoints / "plain"))
    want = expected(recipe, latest_checkpoint(checkpoints / "plain"))
    torch.testing.assert_close(got["outputs"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", [("--tp", "2"), ("--pp", "2")], ids=["tp", "pp"])
def test_a_checkpoint_a_split_replica_wrote_predicts_whole_and_split(write_recipe, tmp_path, split):
    """--tp and --pp write sharded checkpoints of their pieces: predict reads one on one device and
    on the same split, each the checkpoint's model applied in one process."""
    recipe = write_recipe(recipe_of(13))
    trained = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "1", *split, "--steps", "3", "--json",
                      "--checkpoint-dir", str(tmp_path / "ck"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    newest = latest_checkpoint(tmp_path / "ck")
    assert newest.is_dir(), f"{split[0]} wrote a plain file: this test needs its sharded folder"
    want = expected(recipe, newest)
    for flags in ((), ("-s", "mirrored", "--replicas", "1", *split)):
        got = predict(recipe, tmp_path / "out.pt", "--checkpoint-dir", str(tmp_path / "ck"), *flags)
        assert got["checkpoint"] == str(newest)
        torch.testing.assert_close(got["outputs"], want, rtol=1e-5, atol=1e-6, msg=f"predict {' '.join(flags)}")


def test_a_recipe_without_predict_data_is_one_line_before_any_rank_starts(checkpoints, tmp_path):
    result = run_cli("predict", str(checkpoints / ".." / "nothing.py"), "--checkpoint-dir", str(checkpoints / "plain"),
                     "--output", str(tmp_path / "out.pt"))
    assert result.returncode == 2 and "recipe not found" in result.stderr
    recipe = tmp_path / "no_predict.py"
    recipe.write_text(EQUIV)
    result = run_cli("predict", str(recipe), "-s", "mirrored", "--checkpoint-dir", str(checkpoints / "plain"),
                     "--output", str(tmp_path / "out.pt"), "--json")
    assert result.returncode == 3, result.stderr[-2000:]
    line = result.stderr.strip()
    assert line == (f"error: {recipe}: distrun predict needs predict_data(ctx) in the recipe (a map-style dataset "
                    "of the samples to predict, in order)"), line
    assert result.summary["status"] == "failed" and result.summary["error"] == line.removeprefix("error: ")
    assert not (tmp_path / "out.pt").exists()


WIDER = PREDICT.replace("nn.Linear(6, 16)", "nn.Linear(6, 8)").replace("nn.Linear(16, 3)", "nn.Linear(8, 3)")


@pytest.mark.parametrize("strategy, folder, placement", [
    ("mirrored", "plain", ("--replicas", "2")), ("sharded", "sharded", ("--replicas", "2")),
    # Each stage holds part of the model: the whole one's shapes, from before the split, say it.
    ("mirrored", "sharded", ("--replicas", "1", "--pp", "2")),
], ids=["mirrored", "sharded", "pp"])
def test_a_checkpoint_of_another_model_names_the_file_and_the_shapes(checkpoints, write_recipe, tmp_path, strategy,
                                                                     folder, placement):
    assert WIDER != PREDICT, "the recipe's layers changed: update WIDER"
    recipe = write_recipe(recipe_of(5, WIDER))
    result = run_cli("predict", str(recipe), "-s", strategy, *placement, "--output", str(tmp_path / "out.pt"),
                     "--checkpoint-dir", str(checkpoints / folder))
    assert result.returncode == 5, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and "while loading the checkpoint: " in last, last
    newest = latest_checkpoint(checkpoints / folder)
    assert (f"{newest}: not a checkpoint of this model: size mismatch for 0.weight (checkpoint [16, 6], "
            "model [8, 6])") in last, last
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("flags, code, says", [
    ((), 2, "distrun predict needs --checkpoint-dir DIR (the newest checkpoint in it) or --checkpoint PATH"),
    (("--checkpoint-dir", "{tmp}/none"), 5, "--checkpoint-dir {tmp}/none: no such folder"),
    (("--checkpoint-dir", "{tmp}"), 5, "--checkpoint-dir {tmp}: no checkpoint to predict with"),
    (("--checkpoint-dir", "{tmp}", "-s", "ps"), 2, "distrun predict --strategy ps: predict runs here with"),
    (("--checkpoint-dir", "{tmp}", "--cluster", "{tmp}/c.yaml"), 2, "{tmp}/c.yaml: no such file"),
])
def test_bad_flags_are_one_line_with_their_exit_code(write_recipe, tmp_path, flags, code, says):
    recipe = write_recipe(recipe_of(3))
    result = run_cli("predict", str(recipe), "--output", str(tmp_path / "out.pt"),
                     *(flag.format(tmp=tmp_path) for flag in flags))
    assert result.returncode == code, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {says.format(tmp=tmp_path)}"), lines
