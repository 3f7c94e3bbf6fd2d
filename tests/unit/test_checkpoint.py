import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from distrun.errors import CheckpointError
from distrun.strategies import latest_checkpoint, list_checkpoints, load_checkpoint
from distrun.strategies.checkpoint import prune, save_checkpoint


def state(value: float) -> dict:
    return {"model": {"w": torch.full((3,), value)}, "optimizer": {}, "step": int(value)}


def test_writes_plain_weights_only_files_and_keeps_the_last_k(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, state(step))
        prune(tmp_path, 2)
    steps = [s for s, _ in list_checkpoints(tmp_path)]
    assert steps == [4, 5]
    newest = latest_checkpoint(tmp_path)
    data = torch.load(newest, weights_only=True)
    assert data["step"] == 5 and torch.equal(data["model"]["w"], torch.full((3,), 5.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_missing_and_foreign_files_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "ckpt-000000001.pt")
    foreign = tmp_path / "ckpt-000000002.pt"
    torch.save({"weights": 1}, foreign)
    with pytest.raises(CheckpointError, match="not a distrun checkpoint"):
        load_checkpoint(foreign)


WRITER = textwrap.dedent(
    """
    import sys, torch
    from distrun.strategies.checkpoint import prune, save_checkpoint
    big = {"model": {"w": torch.zeros(64, 1024, 1024)}, "optimizer": {}, "step": 2}  # 256 MiB
    save_checkpoint(sys.argv[1], 2, big)
    """
)


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    save_checkpoint(tmp_path, 1, state(1.0))
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".tmp") for p in tmp_path.iterdir()):
        assert writer.poll() is None, "writer finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.001)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert load_checkpoint(latest_checkpoint(tmp_path))["step"] == 1
    # The next save sweeps the dead writer's temporary file.
    save_checkpoint(tmp_path, 3, state(3.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    assert os.path.basename(latest_checkpoint(tmp_path)) == "ckpt-000000003.pt"


def test_a_full_disk_is_named_whatever_wraps_it():
    """DCP gathers each rank's exception into a CheckpointException; a writer's OSError may reach it
    as itself, or only as its words (a RuntimeError from torch's C++ writer): both read "full"."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from distrun.strategies.checkpoint.write_failure import write_failed

    def wrapped(inner):
        return CheckpointException("save", {0: (inner, None), 1: (RuntimeError("peer"), None)})

    for inner in (OSError(errno.ENOSPC, "No space left on device"),
                  RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                               "data/3: file write failed: No space left on device")):
        message = str(write_failed("/ck", 30, wrapped(inner)))
        assert message == "/ck: cannot write the checkpoint of step 30: the disk is full (No space left on device)"
    other = str(write_failed("/ck", 30, wrapped(RuntimeError("boom"))))
    assert other.startswith("/ck: cannot write the checkpoint of step 30: CheckpointException")
