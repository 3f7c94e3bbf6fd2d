"""Sharded checkpoints (DCP folders, every rank writing its own shards) under real
torch.distributed: resharding both ways, a job killed mid-save, --async-checkpoint, and
`distrun checkpoint` over them."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import psutil
import pytest
import torch

from distrun.strategies import latest_checkpoint, list_checkpoints, load_checkpoint
from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration


def _train(recipe, ckpt, strategy, replicas, *extra):
    more = [] if strategy == "one-device" else ["--replicas", str(replicas)]
    result = run_cli("train", str(recipe), "-s", strategy, *more, "--json", "--checkpoint-dir", str(ckpt), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _close(a, b, what):
    assert a.keys() == b.keys(), what
    for key, tensor in b.items():
        torch.testing.assert_close(a[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


def _first_step(result) -> int:
    return next(line["step"] for line in result.json_lines() if line["type"] == "step")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """An uninterrupted 10-step run, and its first 5 steps written by 4 sharded ranks, by 2
    mirrored and by one-device (those two in rank 0's one file)."""
    root = tmp_path_factory.mktemp("reshard")
    recipe = root / "equiv.py"
    recipe.write_text(EQUIV)
    _train(recipe, root / "whole", "one-device", 1, "--steps", "10")
    _train(recipe, root / "sharded4", "sharded", 4, "--steps", "5")
    _train(recipe, root / "mirrored2", "mirrored", 2, "--steps", "5")
    _train(recipe, root / "one1", "one-device", 1, "--steps", "5")
    return root, recipe, load_checkpoint(latest_checkpoint(root / "whole"))


@pytest.mark.parametrize("writer, strategy, replicas", [
    ("sharded4", "sharded", 2), ("sharded4", "sharded", 1), ("sharded4", "mirrored", 2),
    ("sharded4", "one-device", 1), ("mirrored2", "sharded", 4), ("one1", "sharded", 2)])
def test_a_checkpoint_resumes_on_another_world_size_and_strategy(written, tmp_path, writer, strategy, replicas):
    root, recipe, whole = written
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / writer, ckpt)
    if writer == "sharded4":
        assert sorted(p.name for p in latest_checkpoint(ckpt).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    else:
        assert latest_checkpoint(ckpt).name == "ckpt-000000005.pt"  # today's format, rank 0's one file
    result = _train(recipe, ckpt, strategy, replicas, "--steps", "10", "--resume")
    assert _first_step(result) == 6  # it went on from the checkpoint, not from the start
    resumed = load_checkpoint(latest_checkpoint(ckpt))
    assert resumed["step"] == 10 and resumed["num_replicas"] == replicas and resumed["optimizer"]["state"]
    _close(resumed["model"], whole["model"], f"{writer} resumed under {strategy} x{replicas}")


BIG = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 4}

def model():  # 8.4M parameters: with Adam's two moments, a checkpoint of about 100 MB
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

def optimizer(params):
    return torch.optim.Adam(params, lr=1e-4)

def loss(outputs, batch):
    return (outputs - batch[1]).pow(2).mean()

def train_data(ctx):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 1024, generator=gen), torch.randn(64, 1024, generator=gen))
"""

EVAL = """
def eval_data(ctx):
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 1024, generator=gen), torch.randn(16, 1024, generator=gen))
"""


def _kill_tree(proc: subprocess.Popen) -> None:
    parent = psutil.Process(proc.pid)
    family = [parent, *parent.children(recursive=True)]
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)


def test_a_job_killed_mid_save_leaves_the_previous_checkpoint_the_newest(write_recipe, tmp_path):
    """SIGKILL to the launcher and every rank while the shards of a step are being written: the
    checkpoint before it is still the newest, whole, and the job resumes from it to the same
    parameters as a run never killed."""
    recipe = write_recipe(BIG.replace("range(8)", "range(4)"))  # 50 MB a checkpoint: a save still takes a while
    ckpt = tmp_path / "ckpt"
    flags = ["-s", "sharded", "--replicas", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
             "--keep-checkpoints", "2"]
    job = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), *flags, "--steps", "30",
                            "--json"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    caught = None
    try:
        deadline = time.monotonic() + 180
        while caught is None:
            assert job.poll() is None, f"the job ended before a save could be interrupted: {job.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no second save began within 180 s"
            if list_checkpoints(ckpt):  # one complete: now catch the next save with shards on disk
                caught = next((p for p in ckpt.glob(".tmp-ckpt-*") if any(p.glob("*.distcp"))), None)
            time.sleep(0.002)
    finally:
        _kill_tree(job)
    assert caught.exists(), "the kill came after the save was published"
    steps = [step for step, _ in list_checkpoints(ckpt)]
    in_flight = int(caught.name.rsplit("-", 1)[1])
    assert steps and steps[-1] < in_flight, (steps, in_flight)
    newest = load_checkpoint(latest_checkpoint(ckpt))
    assert newest["step"] == steps[-1]
    # It resumes from there; the dead save's folder is swept by the next one.
    end = steps[-1] + 2
    resumed = run_cli("train", str(recipe), *flags, "--steps", str(end), "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _first_step(resumed) == steps[-1] + 1
    assert not list(ckpt.glob(".tmp-ckpt-*"))
    straight = run_cli("train", str(recipe), *flags[:-6], "--checkpoint-dir", str(tmp_path / "straight"),
                       "--steps", str(end), "--json")
    assert straight.returncode == 0, straight.stderr[-3000:]
    _close(load_checkpoint(latest_checkpoint(ckpt))["model"],
           load_checkpoint(latest_checkpoint(tmp_path / "straight"))["model"], "resumed after the kill")


def test_async_checkpoints_hold_the_step_they_were_taken_at(write_recipe, tmp_path):
    """Training goes on (and changes the parameters in place) while each checkpoint is written:
    every async checkpoint still equals the synchronous one of its step. 4.2M parameters (50 MB
    a checkpoint), so each write is still under way when the next step changes the parameters."""
    recipe = write_recipe(BIG.replace("range(8)", "range(4)") + EVAL)
    flags = ("--steps", "8", "--checkpoint-every", "2", "--keep-checkpoints", "4")
    sync = _train(recipe, tmp_path / "sync", "sharded", 2, *flags)
    run = _train(recipe, tmp_path / "async", "sharded", 2, *flags, "--async-checkpoint")
    written = [step for step, _ in list_checkpoints(tmp_path / "async")]
    assert written == [step for step, _ in list_checkpoints(tmp_path / "sync")] == [2, 4, 6, 8]
    for (step, a), (_, s) in zip(list_checkpoints(tmp_path / "async"), list_checkpoints(tmp_path / "sync")):
        first, second = load_checkpoint(a), load_checkpoint(s)
        _close(first["model"], second["model"], f"async checkpoint of step {step}")
        for index, state in second["optimizer"]["state"].items():
            _close(first["optimizer"]["state"][index], state, f"optimizer state {index} at step {step}")
    # Every save was reported, with how long its step waited.
    reported = [line for line in run.json_lines() if line["type"] == "checkpoint"]
    assert [line["step"] for line in reported] == [2, 4, 6, 8]
    assert all(line["blocked_ms"] > 0 for line in reported)
    assert run.summary["checkpoint_blocked_ms"] == max(line["blocked_ms"] for line in reported)
    assert sync.summary["checkpoint_blocked_ms"] > 0
    # The last save is written behind the run's evaluation (which reads the parameters, never
    # changes them): the job waits for it only after evaluating, where a synchronous one came first.
    order = [(line["type"], line["step"]) for line in run.json_lines() if line["type"] in ("checkpoint", "eval")]
    assert order[-2:] == [("eval", 8), ("checkpoint", 8)], order
    order = [(line["type"], line["step"]) for line in sync.json_lines() if line["type"] in ("checkpoint", "eval")]
    assert order[-2:] == [("checkpoint", 8), ("eval", 8)], order


def test_checkpoint_ls_and_export_read_sharded_folders(written, tmp_path):
    root, _, _ = written
    listed = run_cli("checkpoint", "ls", str(root / "sharded4"), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = listed.json_lines()
    assert [(r["step"], r["strategy"], r["world_size"], r["format"]) for r in rows] == [(5, "sharded", 4, "sharded")]
    assert rows[0]["parameters"] == 6 * 16 + 16 + 16 * 3 + 3 and rows[0]["bytes"] > 0
    out = tmp_path / "model.pt"
    exported = run_cli("checkpoint", "export", str(root / "sharded4"), "-o", str(out))
    assert exported.returncode == 0, exported.stderr
    # Read back where distrun cannot be imported: plain torch, weights_only.
    code = ("import sys; sys.modules['distrun'] = None; import torch; "
            f"sd = torch.load({str(out)!r}, weights_only=True); print(sorted(sd), sd['0.weight'].shape)")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "['0.bias', '0.weight', '2.bias', '2.weight'] torch.Size([16, 6])"
    whole = load_checkpoint(latest_checkpoint(root / "sharded4"))["model"]
    _close(torch.load(out, weights_only=True), whole, "exported")
