"""``--profile START:END`` traces that load, and slow ranks named by their compute time.

One job serves most tests (module-scoped): three mirrored ranks, rank 1 made slow on purpose
(it sleeps 40 ms in each loss, the others 10 ms), steps 3-4 profiled. A second job with no
slow rank is the control: no rank may be named there.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch_tb_profiler.profiler.data import RunProfileData

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.integration

# `-- --slow-rank R`: rank R sleeps 40 ms in each loss, every other rank 10 ms (-1: none is slow).
SLOW_RANK_RECIPE = """
import os
import sys
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset

defaults = {"global_batch_size": 48}
RANK = int(os.environ.get("RANK", "0"))
SLOW = int(sys.argv[sys.argv.index("--slow-rank") + 1]) if "--slow-rank" in sys.argv else -1


def model():
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def optimizer(params):
    return torch.optim.SGD(params, lr=0.01)


def loss(outputs, batch):
    time.sleep(0.04 if RANK == SLOW else 0.01)
    return nn.functional.mse_loss(outputs, batch[1])


def train_data(ctx):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(4096, 16, generator=gen), torch.randn(4096, 1, generator=gen))
"""


def _train(recipe: Path, checkpoints: Path, *extra: str, strategy: str = "mirrored", slow_rank: int = 1):
    return run_cli("train", str(recipe), "--strategy", strategy, "--replicas", "3", "--device", "cpu",
                   "--steps", "36", "--log-interval-s", "0.1", "--checkpoint-dir", str(checkpoints), "--json",
                   *extra, "--", "--slow-rank", str(slow_rank))


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """Rank 1 slowed, steps 3-4 profiled: (its --json lines, the checkpoint dir)."""
    folder = tmp_path_factory.mktemp("slowed")
    recipe = folder / "slow.py"
    recipe.write_text(SLOW_RANK_RECIPE)
    result = _train(recipe, folder / "ckpt", "--profile", "3:4")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.json_lines(), folder / "ckpt"


def test_every_rank_writes_one_trace_of_the_window_into_the_checkpoint_dir(slowed):
    lines, checkpoints = slowed
    profiled = sorted((line for line in lines if line["type"] == "profile"), key=lambda line: line["rank"])
    assert [(p["rank"], p["start_step"], p["end_step"]) for p in profiled] == [(0, 3, 4), (1, 3, 4), (2, 3, 4)]
    traces = sorted((checkpoints / "profile").glob("*.pt.trace.json"))
    assert sorted(str(path) for path in traces) == sorted(p["path"] for p in profiled)
    assert [path.name.split(".")[0] for path in traces] == ["rank0", "rank1", "rank2"]
    summary = lines[-1]
    assert summary["profile_dir"] == str(checkpoints / "profile") and summary["profile_traces"] == 3
    # torch's profiler prints on every rank as it starts and stops; the stream drops it
    noise = [line["line"] for line in lines if line["type"] == "output" and "profil" in line["line"]]
    assert noise == []


def test_a_trace_loads_as_chrome_trace_with_steps_shapes_and_memory(slowed):
    _, checkpoints = slowed
    trace = next((checkpoints / "profile").glob("rank1.*.pt.trace.json"))
    events = json.loads(trace.read_text())["traceEvents"]  # what Perfetto opens: Chrome's trace format
    assert sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")) == [
        "ProfilerStep#3", "ProfilerStep#4"]
    shaped = [e for e in events if e.get("name") == "aten::addmm"]
    assert shaped and all("Input Dims" in e["args"] for e in shaped)  # record_shapes
    assert any(e.get("name") == "[memory]" for e in events)  # profile_memory
    assert any(e.get("name", "").startswith("c10d::allreduce") for e in events)  # the gradients' all-reduce


def test_tensorboards_profiler_plugin_parses_a_trace(slowed):
    """torch-tb-profiler's own parser (what `tensorboard --logdir` runs) reads both steps."""
    _, checkpoints = slowed
    trace = next((checkpoints / "profile").glob("rank0.*.pt.trace.json"))
    data = RunProfileData.parse("rank0", 1, str(trace), None)
    data.process()
    assert data.steps_names == ["3", "4"]


def test_the_slowed_rank_is_named_a_straggler_and_no_other(slowed):
    lines, _ = slowed
    named = [line for line in lines if line["type"] == "straggler"]
    assert [(line["rank"], line["recovered"]) for line in named] == [(1, False)], named
    straggler = named[0]
    # 40 ms of sleep against 10 ms: well above the 1.25x threshold, for 3 intervals in a row
    assert straggler["ratio"] > 2.0 and straggler["intervals"] == 3
    assert straggler["compute_ms"] > 40 > straggler["median_ms"]
    # every rank's step takes the same wall time (the all-reduce waits for rank 1): compute time tells them apart
    last = {line["rank"]: line for line in lines if line["type"] == "step" and line.get("compute_ms") is not None}
    assert last[0]["step_ms"] == pytest.approx(last[1]["step_ms"], rel=0.2)
    assert last[1]["compute_ms"] > 2 * max(last[0]["compute_ms"], last[2]["compute_ms"])
    assert list(lines[-1]["stragglers"]) == ["1"] and lines[-1]["stragglers"]["1"] >= straggler["ratio"] - 0.01


def test_no_rank_is_named_when_none_is_slow(tmp_path):
    recipe = tmp_path / "even.py"
    recipe.write_text(SLOW_RANK_RECIPE)
    result = _train(recipe, tmp_path / "ckpt", slow_rank=-1)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.json_lines()
    assert [line for line in lines if line["type"] == "straggler"] == []
    assert lines[-1]["stragglers"] == {}
    assert any(line.get("compute_ms") for line in lines if line["type"] == "step")  # figures came; none stood out


def test_under_sharded_the_slowed_rank_is_named_from_fsdps_own_waits(tmp_path):
    """FSDP2 waits in its gathers and reduce-scatters, not after the gradients: timed there."""
    recipe = tmp_path / "slow.py"
    recipe.write_text(SLOW_RANK_RECIPE)
    result = _train(recipe, tmp_path / "ckpt", strategy="sharded")
    assert result.returncode == 0, result.stderr[-3000:]
    named = [(line["rank"], line["recovered"]) for line in result.json_lines() if line["type"] == "straggler"]
    assert named == [(1, False)]


def test_a_plain_script_is_profiled_from_its_first_step(tmp_path):
    """A script distrun does not step: the window opens before the script runs, closes after step 2."""
    result = run_cli("train", str(REPO / "recipes" / "torchrun_script.py"), "-s", "mirrored", "--replicas", "2",
                     "--checkpoint-dir", str(tmp_path), "--profile", "1:2", "--json", "--", "--steps", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    profiled = sorted((line["rank"], line["start_step"], line["end_step"])
                      for line in result.json_lines() if line["type"] == "profile")
    assert profiled == [(0, 1, 2), (1, 1, 2)]
    trace = next((tmp_path / "profile").glob("rank0.*.pt.trace.json"))
    steps = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert sorted(steps) == ["ProfilerStep#1", "ProfilerStep#2"]
