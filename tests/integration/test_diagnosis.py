"""A local job stuck on purpose: --hang-timeout-s prints every rank's stack and Flight Recorder.

Three gloo ranks; rank 1 sleeps in the recipe's loss at its fifth step, the other two wait
for it in the gradient all-reduce. Real processes, real py-spy, torch's own Flight Recorder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distrun.client._diagnosis import read_record
from tests.conftest import REPO, assert_no_processes

pytestmark = pytest.mark.integration

STUCK_ON_RANK_1 = """
import os, time
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 12, "epochs": 1000}
STEPS = [0]

def model():
    return nn.Linear(2, 1)

def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)

def loss(outputs, batch):
    STEPS[0] += 1
    if os.environ["RANK"] == "1" and STEPS[0] == 5:
        time.sleep(3600)  # stuck here, alive
    return nn.functional.mse_loss(outputs, batch[1])

def train_data(ctx):
    return TensorDataset(torch.randn(64, 2), torch.randn(64, 1))
"""


def test_a_hang_prints_collapsed_stacks_and_names_the_rank_behind_in_the_flight_recorder(tmp_path: Path) -> None:
    recipe = tmp_path / "stuck.py"
    recipe.write_text(STUCK_ON_RANK_1)
    proc = subprocess.Popen([sys.executable, "-m", "distrun", "train", str(recipe), "--strategy", "mirrored",
                             "--replicas", "3", "--hang-timeout-s", "4", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    found = None
    try:
        for line in proc.stdout:
            if line.startswith('{"type":"diagnosis"'):
                found = json.loads(line)
                break
            assert not line.startswith('{"type":"summary"'), "the job ended instead of hanging"
    finally:
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    assert found is not None, err[-2000:]
    assert found["reason"] == "hang"
    by_rank = {stack["rank"]: stack for stack in found["stacks"]}
    assert sorted(by_rank) == [0, 1, 2] and all(stack["error"] is None for stack in by_rank.values())
    # The stuck rank stands in the recipe's loss; the two waiting ranks stand at the same frames, in torch.
    stuck = by_rank[1]["frames"][0]
    assert (stuck["function"], stuck["file"], stuck["user"]) == ("loss", "stuck.py", True)
    assert by_rank[0]["frames"] == by_rank[2]["frames"]
    assert by_rank[0]["frames"][0]["file"].startswith("torch/") and not any(f["user"] for f in by_rank[0]["frames"])
    # The Flight Recorder: ranks 0 and 2 wait in a collective rank 1 never entered.
    records = {record["rank"]: record for record in found["collectives"]}
    assert records[0]["seq"] == records[2]["seq"] == records[1]["seq"] + 1
    assert not records[0]["completed"] and records[1]["completed"]
    assert found["missing"] == [1] and found["awaited"] == f"#{records[0]['seq']} gloo:all_reduce"
    # The dumps are torch's own, kept where the line says.
    dump_dir = Path(found["dump_dir"])
    for rank in (0, 1, 2):
        raw = (dump_dir / f"flight-recorder-rank-{rank}.json").read_bytes()
        assert read_record(rank, "localhost", raw).seq == records[rank]["seq"]
        assert "entries" in json.loads(raw)
    assert proc.returncode == 130
    assert_no_processes(str(recipe))
    for name in os.listdir(dump_dir):
        os.unlink(dump_dir / name)
    os.rmdir(dump_dir)
