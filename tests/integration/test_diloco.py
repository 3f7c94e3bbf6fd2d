"""``--strategy diloco`` on real gloo groups on the CPU: mirrored's step exactly at H=1, int8 and
streaming syncs that train, checkpoints that resume under diloco and under other strategies,
evaluation at the end of every run, and one-line refusals."""

from __future__ import annotations

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]


#: SGD with momentum: linear in the gradient, so at H=1 with outer lr 1 and no outer momentum
#: the mean of the replicas' steps is mirrored's, and so one-device's (each replica's buffer is
#: its share of the mean's). 97 samples at batch 16: the 7th batch is one sample, one replica's
#: share empty, so the uneven last batch's weighting is checked too.
RECIPE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 16}


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def shard_units(net):
    return [net[0], net[2], net[4]]


def optimizer(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def loss(outputs, batch):
    return nn.functional.cross_entropy(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(97, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def eval_data(ctx):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(41, 6, generator=gen)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
"""

EXACT = ("--sync-every", "1", "--outer-lr", "1", "--outer-momentum", "0")


def _train(recipe, ckpt, *flags):
    result = run_cli("train", str(recipe), "--json", "--checkpoint-dir", str(ckpt), *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, load_checkpoint(latest_checkpoint(ckpt))


def _close(a, b, what, atol=1e-6):
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))}"
    for key, tensor in b.items():
        torch.testing.assert_close(a[key], tensor, rtol=0, atol=atol, msg=f"{what}: {key}")


def _events(result, kind):
    return [e for e in result.json_lines() if e["type"] == kind]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("diloco") / "mlp.py"
    path.write_text(RECIPE)
    return path


@pytest.fixture(scope="module")
def one_device(recipe, tmp_path_factory):
    """The reference: 8 steps on one device (the 8th is in the second epoch)."""
    return _train(recipe, tmp_path_factory.mktemp("one"), "--steps", "8")


def test_one_sync_per_step_is_mirroreds_step_exactly(recipe, one_device, tmp_path):
    """H=1, outer lr 1, no outer momentum: one-device's parameters after 8 steps, to float tolerance;
    the run ends mid-epoch and still evaluates."""
    result, data = _train(recipe, tmp_path / "ckpt", "-s", "diloco", "--replicas", "2", "--steps", "8", *EXACT)
    _close(data["model"], one_device[1]["model"], "diloco at H=1 against one-device")
    summary = result.summary
    assert (summary["strategy"], summary["steps"], summary["outer_steps"]) == ("diloco", 8, 8)
    syncs = _events(result, "sync")
    assert [s["step"] for s in syncs] == list(range(1, 9))
    assert all(s["bytes_sent"] == 4 * s["elements"] for s in syncs), syncs[0]  # ring of 2: the payload once
    assert summary["eval_metrics"]["loss"] == pytest.approx(one_device[0].summary["eval_metrics"]["loss"], abs=1e-5)
    assert [e["step"] for e in _events(result, "eval")] == [7, 8]  # the first epoch's end (7 batches), then the run's


def test_int8_streaming_syncs_train_and_every_n_steps_evaluate(recipe, tmp_path):
    """int8 pseudo-gradients, three fragments staggered over H=6: every fragment syncs in turn,
    the bytes are int8's, the replicas end on the global weights, and --eval-every 6 evaluates."""
    result, data = _train(recipe, tmp_path / "ckpt", "-s", "diloco", "--replicas", "2", "--steps", "18",
                          "--sync-every", "6", "--sync-dtype", "int8", "--fragments", "3", "--eval-every", "6",
                          "-b", "32")
    syncs = _events(result, "sync")
    # Fragment k launches at step 2(k+1) of every 6 and lands one step later; the run's end
    # lands the one in flight and syncs the two that did not just land.
    assert [(s["step"], s["fragment"]) for s in syncs] == [
        (3, 0), (5, 1), (7, 2), (9, 0), (11, 1), (13, 2), (15, 0), (17, 1), (18, 2), (18, 0), (18, 1)]
    assert all(s["dtype"] == "int8" for s in syncs)
    # int8: one byte per element, twice (N-1)/N of them, plus the scales.
    assert all(s["elements"] <= s["bytes_sent"] < 2 * s["elements"] for s in syncs), syncs
    summary = result.summary
    assert summary["outer_steps"] == 3 and summary["sync_mb"] > 0
    losses = [e["metrics"]["loss"] for e in _events(result, "eval")]
    # Every 6 steps, and each epoch's end (4 batches of 32): 12 is both, evaluated once.
    assert [e["step"] for e in _events(result, "eval")] == [4, 6, 8, 12, 16, 18]
    assert losses[-1] < losses[0], losses
    assert data["strategy"] == "diloco" and len(data["comm"]["diloco"]["inner"]) == 2
    # The run's last evaluation ran the weights its checkpoint holds (the global ones): one device
    # resuming it past its end evaluates them again, to the same loss.
    again = run_cli("train", str(recipe), "--json", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                    "--steps", "18", "-b", "32")
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.summary["eval_metrics"]["loss"] == pytest.approx(losses[-1], abs=1e-6)


def test_a_diloco_checkpoint_resumes_exactly_and_under_other_strategies(recipe, tmp_path):
    """Stopping at a sync and resuming gives the uninterrupted run's parameters (every replica's
    inner momentum and the outer momentum come back); the checkpoint's model is the global
    weights, which mirrored resumes and `checkpoint export` writes whole."""
    flags = ("-s", "diloco", "--replicas", "2", "--sync-every", "2")
    _, whole = _train(recipe, tmp_path / "whole", *flags, "--steps", "8")
    _train(recipe, tmp_path / "split", *flags, "--steps", "4")
    result, resumed = _train(recipe, tmp_path / "split", *flags, "--steps", "8", "--resume")
    _close(resumed["model"], whole["model"], "resumed against uninterrupted")
    assert result.summary["outer_steps"] == 4 and result.summary["resumed"]["step"] == 4
    result, mirrored = _train(recipe, tmp_path / "split", "-s", "mirrored", "--steps", "10", "--resume")
    assert mirrored["strategy"] == "mirrored" and mirrored["step"] == 10
    # ... and back: a mirrored checkpoint resumes under diloco (bf16 on the wire).
    result, back = _train(recipe, tmp_path / "split", *flags, "--steps", "12", "--resume", "--sync-dtype", "bf16")
    assert back["strategy"] == "diloco" and back["step"] == 12 and result.summary["outer_steps"] == 1
    exported = tmp_path / "export.pt"
    result = run_cli("checkpoint", "export", str(tmp_path / "whole"), "-o", str(exported))
    assert result.returncode == 0, result.stderr
    _close(torch.load(exported, weights_only=True), whole["model"], "exported")


@pytest.mark.parametrize("strategy", ["mirrored", "sharded", "central-storage", "parameter-server"])
def test_every_strategy_evaluates_at_its_end_and_every_n_steps(recipe, tmp_path, strategy):
    """A --steps run that ends mid-epoch evaluates at its end; --eval-every 2 evaluates at 2 and 4."""
    result = run_cli("train", str(recipe), "--json", "-s", strategy, "--steps", "5", "--eval-every", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [e["step"] for e in _events(result, "eval")]
    if strategy == "parameter-server":  # asynchronous: the chief's step may pass a multiple of 2 between batches
        # (one worker may take every step before the chief takes one): the end's evaluation is certain.
        assert evals == sorted(set(evals)) and evals[-1] >= 5, evals
    else:
        assert evals == [2, 4, 5], evals
    assert result.summary["eval_metrics"]["loss"] > 0


@pytest.mark.parametrize("flags, says", [
    (("--sync-every", "0"), "--sync-every: expected a positive number"),
    (("--outer-lr", "0"), "--outer-lr: expected a positive learning rate"),
    (("--outer-lr", "-1"), "--outer-lr: expected a positive learning rate"),
    (("--sync-every", "4", "--checkpoint-every", "6", "--checkpoint-dir", "x"), "give a multiple of --sync-every 4"),
    (("--fragments", "3", "--sync-every", "2"), "--fragments 3: each fragment syncs at its own step"),
    (("--sync-dtype", "int4"), "--sync-dtype: expected fp32, bf16, int8"),
])
def test_bad_diloco_flags_get_one_line(recipe, flags, says):
    result = run_cli("train", str(recipe), "-s", "diloco", *flags)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_more_fragments_than_units_and_one_replica(recipe, tmp_path):
    """--fragments beyond the model's units is named before step 1; diloco with one replica says it
    is one-device and runs as one."""
    result = run_cli("train", str(recipe), "--json", "-s", "diloco", "--fragments", "4", "--sync-every", "8")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--fragments 4: the model has 3 unit(s)" in result.summary["error"]
    result = run_cli("train", str(recipe), "--json", "-s", "diloco", "--replicas", "1", "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "is one-device training" in result.stderr and result.summary["strategy"] == "one-device"


def test_a_lost_replica_loses_only_its_inner_steps_and_rejoins_at_a_sync(tmp_path):
    """--elastic 2:3, rank 2 SIGKILLed in step 12 of H=5: the survivors go on alone, find it gone at
    the sync of step 15, redo that sync between them (no outer step lost), and the restarted rank
    joins at a later sync from the global weights."""
    from tests.integration._recipes import ELASTIC

    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = run_cli("train", str(recipe), "--json", "-s", "diloco", "--replicas", "3", "--elastic", "2:3",
                     "--sync-every", "5", "--steps", "40", "--checkpoint-dir", str(tmp_path / "ck"), "--",
                     "--die-rank", "2", "--die-at", "12", "--once", str(tmp_path / "once"), "--sleep-s", "0.2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.json_lines()
    changes = [line for line in lines if line["type"] == "membership"]
    assert [c["world_size"] for c in changes] == [2, 3], changes
    assert changes[0]["left"] == ["rank 2 on 127.0.0.1 (killed by SIGKILL)"] and changes[0]["step"] == 15  # the sync it redid
    assert changes[1]["joined"] == ["rank 2 on 127.0.0.1"] and changes[1]["step"] % 5 == 0
    syncs = [line["step"] for line in lines if line["type"] == "sync"]
    assert syncs == list(range(5, 45, 5)), syncs  # every outer step once: step 15's redone by the survivors
    summary = result.summary
    assert (summary["steps"], summary["outer_steps"], summary["steps_lost"]) == (40, 8, 0)
    assert summary["membership_changes"] == 2 and summary["world_size"] == 3
    data = load_checkpoint(latest_checkpoint(tmp_path / "ck"))
    assert data["step"] == 40 and len(data["comm"]["diloco"]["inner"]) == 3


def test_a_member_lost_inside_a_joiners_heal_is_recovered_from_again(tmp_path):
    """As above, and when rank 2 rejoins, rank 1 dies inside the heal that brings it in, in its
    second collective (the global weights), the first (the state) done. Rank 0 and the joiner
    recover again (before: the joiner's heal was not tried again, and rank 0 failed on gloo's
    "Connection closed by peer"), and meet the next sync from either side of it, one owing it,
    one training to it again, over a wire of one size (before the weight rode on owed syncs
    alone: rank 0 aborted on gloo's "164 vs 160" size check). No outer step is lost."""
    from tests.integration._recipes import ELASTIC

    recipe = tmp_path / "elastic.py"
    recipe.write_text(ELASTIC)
    result = run_cli("train", str(recipe), "--json", "-s", "diloco", "--replicas", "3", "--elastic", "2:3",
                     "--sync-every", "5", "--steps", "40", "--", "--die-rank", "2", "--die-at", "12",
                     "--once", str(tmp_path / "once"), "--sleep-s", "0.2", "--die-in-global", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.json_lines()
    assert [line["returncode"] for line in lines if line["type"] == "exited" and line["rank"] == 1][0] == -9
    assert [line["returncode"] for line in lines if line["type"] == "exited" and line["rank"] == 0] == [0]
    changes = [line for line in lines if line["type"] == "membership"]
    assert any(any(who.startswith("rank 1 on 127.0.0.1") for who in c["left"]) and c["joined"] == ["rank 2 on 127.0.0.1"]
               for c in changes), changes
    syncs = [line["step"] for line in lines if line["type"] == "sync"]
    assert syncs == list(range(5, 45, 5)), syncs  # every outer step once
    summary = result.summary
    assert (summary["steps"], summary["outer_steps"], summary["steps_lost"], summary["restarts"]) == (40, 8, 0, 0)
