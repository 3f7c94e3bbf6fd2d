"""A custom loop gets what a fit recipe gets (issue 47, item 6): the job's options as
``strategy.options``, ``strategy.save(extra=...)`` given back by ``restore`` (on another replica
count too), ``strategy.report_samples(n)`` for the live view's samples/s, the "resumed from ... at
step N" line, and the job's seed set before ``main`` runs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

TOLERANCE = 2e-4  # test_model_parallel's bound against one-device

LOOP = '''
import json
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

_gen = torch.Generator().manual_seed(7)
_x = torch.randn(96, 4, generator=_gen)
_y = _x.sum(dim=1, keepdim=True).sin()


def _factor(step):  # a different lr at every step: a schedule that did not travel ends elsewhere
    return 0.9 ** step


def main(strategy):
    options = strategy.options
    per_step = int(options.args[options.args.index("--batches") + 1]) if "--batches" in options.args else 1
    with strategy.scope():
        model = nn.Linear(4, 1)
    if not model.weight.is_meta:  # sharded builds it on the meta device (rank 0's weights are broadcast)
        print(f"init {float(model.weight[0, 0].detach())!r}", flush=True)
    print(f"options epochs={options.epochs} eval_every={options.eval_every} clip={options.clip_grad_norm} "
          f"keep={options.keep}", flush=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = strategy.prepare(model, optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _factor)
    data = strategy.distribute_dataset(TensorDataset(_x, _y), options.global_batch_size)
    if options.resume:
        extra = strategy.restore(options.checkpoint_dir)["extra"]
        schedule.load_state_dict(extra["schedule"])
        if strategy.is_chief:
            print("extra " + json.dumps(extra, sort_keys=True), flush=True)

    def step(batches):
        optimizer.zero_grad()
        for inputs, targets in batches:  # the loop's own accumulation: several batches a step
            if "--forward-backward" in options.args:  # distrun's: --accumulate splits the batch
                loss = strategy.forward_backward(model, (inputs, targets), lambda out, b: (out - b[1]).pow(2).mean())
                continue
            loss = strategy.compute_average_loss((model(inputs) - targets).pow(2).mean(dim=1)) / len(batches)
            loss.backward()
            if "--report" in options.args:
                strategy.report_samples(len(inputs))
        optimizer.step()
        schedule.step()
        time.sleep(0.005)  # a step's time that the machine's load barely changes: samples/s is steady
        return loss.detach()

    batches = iter(())
    while strategy.step < (options.steps if options.steps is not None else 2):  # --epochs alone: 2, its own choice
        group = []
        while len(group) < per_step:
            batch = next(batches, None)
            if batch is None:
                batches = iter(data)
                continue
            group.append(batch)
        strategy.run(step, group)
        if options.checkpoint_dir and strategy.step % options.checkpoint_every == 0:
            extra = {"schedule": schedule.state_dict(), "at": strategy.step, "pair": (1, 2)}
            if "--tensor-in-extra" in options.args:
                extra["weight"] = model.weight.detach()
            strategy.save(options.checkpoint_dir, extra=extra)
'''


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop") / "loop.py"
    path.write_text(LOOP)
    return path


def _train(recipe, *flags):
    result = run_cli("train", str(recipe), "--json", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _printed(result, prefix):
    return [e["line"].removeprefix(prefix) for e in result.json_lines()
            if e["type"] == "output" and e["rank"] == 0 and e["line"].startswith(prefix)]


def test_extra_state_comes_back_on_resume_on_another_replica_count(loop, tmp_path):
    """mirrored x2 to step 6 (a checkpoint every 3 steps, each with the schedule in ``extra``), then
    one-device to 12 with --resume: the loop gets its extra state back, JSON's plain values (the
    tuple a list), the summary and the "resumed" line say step 6, and the run ends where an
    uninterrupted one-device run of 12 steps ends."""
    flags = ("-b", "8", "--checkpoint-every", "3")
    whole = _train(loop, "--steps", "12", "--checkpoint-dir", str(tmp_path / "whole"), *flags)
    ckpt = tmp_path / "ck"
    first = _train(loop, "-s", "mirrored", "--replicas", "2", "--steps", "6", "--checkpoint-dir", str(ckpt), *flags)
    assert first.summary["steps"] == 6
    resumed = _train(loop, "--steps", "12", "--checkpoint-dir", str(ckpt), "--resume", *flags)

    extra = json.loads(_printed(resumed, "extra ")[0])
    assert (extra["at"], extra["pair"], extra["schedule"]["last_epoch"]) == (6, [1, 2], 6), extra
    summary = resumed.summary
    assert summary["resumed"]["step"] == 6 and summary["resumed"]["path"].endswith("ckpt-000000006.pt"), summary
    assert summary["steps"] == 12
    end, reference = (load_checkpoint(latest_checkpoint(folder)) for folder in (ckpt, tmp_path / "whole"))
    assert end["extra"]["schedule"]["last_epoch"] == 12
    for key, tensor in reference["model"].items():
        torch.testing.assert_close(end["model"][key], tensor, rtol=0, atol=TOLERANCE, msg=key)

    human = run_cli("train", str(loop), "--steps", "12", "--checkpoint-dir", str(ckpt), "--resume", *flags)
    assert human.returncode == 0, human.stderr[-3000:]
    assert f"resumed from {ckpt}/ckpt-000000012.pt at step 12" in human.stdout + human.stderr


def test_the_seed_is_set_and_options_reach_the_loop(loop, tmp_path):
    """``--seed 5``: the model the loop builds is the one ``torch.manual_seed(5)`` gives, on every
    replica; ``--steps`` is the live view's total."""
    result = _train(loop, "-s", "mirrored", "--replicas", "2", "-b", "8", "--steps", "3", "--seed", "5",
                    "--eval-every", "2", "--clip-grad-norm", "1.5", "--keep-checkpoints", "2")
    torch.manual_seed(5)
    expected = float(nn.Linear(4, 1).weight[0, 0].detach())
    inits = {e["rank"]: float(e["line"].split()[1]) for e in result.json_lines()
             if e["type"] == "output" and e["line"].startswith("init ")}
    assert inits == {0: expected, 1: expected}, inits
    totals = {e["total_steps"] for e in result.json_lines() if e["type"] == "step"}
    assert totals == {3}, totals
    said = {e["line"] for e in result.json_lines() if e["type"] == "output" and e["line"].startswith("options ")}
    assert said == {"options epochs=None eval_every=2 clip=1.5 keep=2"}, said  # every replica, the job's own
    epochs = _train(loop, "-b", "8", "--epochs", "1")
    said = {e["line"] for e in epochs.json_lines() if e["type"] == "output" and e["line"].startswith("options ")}
    assert said == {"options epochs=1 eval_every=None clip=None keep=3"}, said


def test_reported_samples_make_the_samples_per_second(loop):
    """A step of 4 batches of 8: with ``report_samples`` each counts, so samples/s is about 4x that
    of the same run counting only the last batch (the default), not the issue's quarter."""
    runs = {}
    for report in ((), ("--report",)):
        result = _train(loop, "-b", "8", "--steps", "40", "--", "--batches", "4", *report)
        runs[bool(report)] = result.summary["samples_per_s"]
    ratio = runs[True] / runs[False]
    assert 2.5 < ratio < 6.0, runs


def test_extra_state_that_a_checkpoint_cannot_keep_is_one_line_exit_3(loop, tmp_path):
    result = run_cli("train", str(loop), "-b", "8", "--steps", "3", "--checkpoint-every", "3",
                     "--checkpoint-dir", str(tmp_path / "ck"), "--", "--tensor-in-extra")
    assert result.returncode == 3, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "strategy.save(extra=...): Object of type Tensor is not JSON serializable; a checkpoint keeps plain " \
           "values" in last and "loop.py:" in last, last


@pytest.mark.parametrize("flags", [("-s", "mirrored", "--replicas", "2", "--accumulate", "2"),
                                   ("-s", "sharded", "--replicas", "2", "--accumulate", "4")],
                         ids=["mirrored-acc2", "sharded-acc4"])
def test_a_loops_forward_backward_accumulates_to_one_devices_parameters(loop, tmp_path, flags):
    """A custom loop that calls ``strategy.forward_backward`` gets --accumulate: each replica's batch
    in N micro-batches, gradients synchronised once, one-device's parameters at the same global batch."""
    common = ("-b", "16", "--steps", "6", "--checkpoint-every", "6")
    _train(loop, *common, "--checkpoint-dir", str(tmp_path / "one"), "--", "--forward-backward")
    result = _train(loop, *common, *flags, "--checkpoint-dir", str(tmp_path / "acc"), "--", "--forward-backward")
    parts = int(flags[flags.index("--accumulate") + 1])
    assert (result.summary["micro_batch_size"], result.summary["accumulate"]) == (16 // 2 // parts, parts)
    one, acc = (load_checkpoint(latest_checkpoint(tmp_path / name)) for name in ("one", "acc"))
    for key, tensor in one["model"].items():
        torch.testing.assert_close(acc["model"][key], tensor, rtol=0, atol=TOLERANCE, msg=key)


def test_extra_state_comes_back_from_a_sharded_checkpoint(loop, tmp_path):
    """sharded x2 writes a folder of shards (the extra state in its JSON): a one-device resume gets
    the same extra back, tensors and tuples as a plain checkpoint gives them."""
    ckpt = tmp_path / "ck"
    flags = ("-b", "8", "--checkpoint-every", "3", "--checkpoint-dir", str(ckpt))
    _train(loop, "-s", "sharded", "--replicas", "2", "--steps", "6", *flags)
    assert latest_checkpoint(ckpt).is_dir(), "sharded wrote a plain file: this test needs its folder"
    resumed = _train(loop, "--steps", "9", "--resume", *flags)
    extra = json.loads(_printed(resumed, "extra ")[0])
    assert (extra["at"], extra["pair"], extra["schedule"]["last_epoch"]) == (6, [1, 2], 6), extra
    assert load_checkpoint(latest_checkpoint(ckpt))["extra"]["schedule"]["last_epoch"] == 9
