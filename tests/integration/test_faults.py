"""Faults a shared machine brings (issue 33): a disk that fills up mid-checkpoint, and the
kernel's out-of-memory killer. Each ends in one line that says what happened, and loses
nothing that was saved.

Real parts: a 700 KB tmpfs as ``--checkpoint-dir`` (mounted here, as root), and a v1 memory
cgroup (/sys/fs/cgroup/memory) with a limit the job's rank 1 goes past, so the kernel's own
OOM killer ends it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.integration

#: ~270 KB a checkpoint (a 64-448-8 MLP, SGD with momentum): two fit in 700 KB, a third does not.
WIDE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 32, "epochs": 100}


def model():
    return nn.Sequential(nn.Linear(64, 448), nn.ReLU(), nn.Linear(448, 8))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def loss(outputs, batch):
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(512, 64, generator=g), torch.randn(512, 8, generator=g))
"""

#: Rank 1 takes 2 GB at its 8th step, more than the job's cgroup allows.
HOG = """
import os
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 32, "epochs": 1000}
_calls = [0]


def model():
    return nn.Linear(8, 1)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)


def loss(outputs, batch):
    _calls[0] += 1
    if _calls[0] == 8 and os.environ.get("RANK") == "1":
        hog = torch.ones(2 * 2**30 // 4)  # 2 GB, every page touched
        time.sleep(30)  # the kernel ends this long before
    time.sleep(0.02)
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    return TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
"""


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """A 700 KB tmpfs: the disk that fills up. Emptied by each test that uses it."""
    point = tmp_path_factory.mktemp("small-disk")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(point)],
                             capture_output=True, text=True)
    assert mounted.returncode == 0, f"these tests mount a tmpfs and need root: {mounted.stderr.strip()}"
    yield point
    subprocess.run(["umount", "-l", str(point)], check=False)


def _empty(folder: Path) -> Path:
    for entry in folder.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    return folder / "ck"


def _left_behind(ckpt: Path) -> list[str]:
    return sorted(entry.name for entry in ckpt.iterdir() if entry.name.startswith(".tmp"))


@pytest.mark.parametrize("strategy, extra, newest", [
    ("mirrored", [], "ckpt-000000020.pt"),
    ("sharded", [], "ckpt-000000020"),
    ("sharded", ["--async-checkpoint"], "ckpt-000000020"),
])
def test_a_full_disk_is_a_checkpoint_error_that_names_it_and_leaves_nothing_partial(
        write_recipe, small_disk, strategy, extra, newest):
    recipe = write_recipe(WIDE)
    ckpt = _empty(small_disk)
    result = run_cli("train", str(recipe), "-s", strategy, "--replicas", "2", "--steps", "40",
                     "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10", *extra)
    assert result.returncode == 5, result.stderr[-3000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, result.stderr[-3000:]
    line = error[0]
    # What happened, where, to which step's save, and what a resume would take.
    assert "the disk is full (No space left on device)" in line, line
    assert f"{ckpt}: cannot write the checkpoint of step 30" in line, line
    assert f"the newest complete checkpoint is {ckpt / newest} (step 20)" in line, line
    assert "while saving a checkpoint" in line or "while writing a checkpoint in the background" in line, line
    assert "at step 31" not in line and "Traceback" not in result.stderr
    assert _left_behind(ckpt) == [], "a failed save leaves nothing partial"
    assert sorted(entry.name for entry in ckpt.iterdir()) == [newest.replace("20", "10"), newest]


def test_a_resume_whose_save_fails_still_reports_the_checkpoint_it_resumed_from(write_recipe, small_disk):
    recipe = write_recipe(WIDE)
    ckpt = _empty(small_disk)
    first = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "20",
                    "--checkpoint-dir", str(ckpt), "--checkpoint-every", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--steps", "25", "--resume",
                      "--checkpoint-dir", str(ckpt), "--json")
    assert resumed.returncode == 5, resumed.stderr[-3000:]
    summary = resumed.summary
    assert summary["last_checkpoint"] == str(ckpt / "ckpt-000000020.pt"), summary
    assert "cannot write the checkpoint of step 25: the disk is full" in summary["error"], summary["error"]
    assert _left_behind(ckpt) == []


@pytest.fixture
def memory_cgroup(tmp_path):
    """A v1 memory cgroup that allows 1.5 GB; removed after the test."""
    root = Path("/sys/fs/cgroup/memory")
    assert (root / "cgroup.procs").is_file(), \
        "this test needs the v1 memory controller at /sys/fs/cgroup/memory (it makes a cgroup there)"
    group = root / f"distrun-test-oom-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(1536 * 2**20))
    if (group / "memory.memsw.limit_in_bytes").is_file():  # no swapping out instead: the OOM killer it is
        (group / "memory.memsw.limit_in_bytes").write_text(str(1536 * 2**20))
    yield group
    for _ in range(50):  # the processes in it are gone once the job ends; an rmdir may race their exit
        try:
            group.rmdir()
            break
        except OSError:
            subprocess.run(["sleep", "0.1"])


def test_a_rank_the_oom_killer_ends_is_named_with_its_cgroup_limit(write_recipe, memory_cgroup, tmp_path):
    recipe = write_recipe(HOG)
    # The job's launcher joins the cgroup before it starts; its ranks are born in it.
    command = ("echo $$ > \"$1\"/cgroup.procs && shift && exec \"$@\"")
    proc = subprocess.run(
        ["sh", "-c", command, "sh", str(memory_cgroup), sys.executable, "-m", "distrun", "train", str(recipe),
         "-s", "mirrored", "--replicas", "2", "--steps", "40"],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, "DISTRUN_HOME": str(tmp_path / "home")},  # no warm server's ranks: ours, in the cgroup
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    kills = (memory_cgroup / "memory.oom_control").read_text()
    assert "oom_kill 1" in kills, kills  # the kernel did kill one process in it
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert error[0].startswith("error: rank 1 was killed by the kernel's out-of-memory killer"), error[0]
    assert f"its memory cgroup /{memory_cgroup.name} allows 1.5 GB" in error[0], error[0]
    assert "rank 1 last reported a peak of" in error[0], error[0]
