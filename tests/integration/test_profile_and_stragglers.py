"""``--profile START:END`` traces that load, and slow ranks named by their compute time.

One job serves most tests (module-scoped): three mirrored ranks, rank 1 made slow on purpose
(it sleeps 120 ms in each loss, the others 30 ms: wide enough apart that a loaded 2-core
machine's noise cannot close the gap), steps 3-4 profiled. A second job with no
slow rank is the control: no rank may be named there.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from torch_tb_profiler.profiler.data import RunProfileData

from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV, RAISES_IN_RANK_1, SLOW_RANK_RECIPE

pytestmark = pytest.mark.integration

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
    # 120 ms of sleep against 30 ms: well above the 1.25x threshold, for 3 intervals in a row
    assert straggler["ratio"] > 2.0 and straggler["intervals"] == 3
    assert straggler["compute_ms"] > 100 > straggler["median_ms"]
    # every rank's step takes the same wall time (the all-reduce waits for rank 1): compute time tells them apart
    steps = [line for line in lines if line["type"] == "step" and line.get("compute_ms") is not None]
    step_ms = {rank: statistics.median(l["step_ms"] for l in steps if l["rank"] == rank) for rank in (0, 1, 2)}
    compute_ms = {rank: statistics.median(l["compute_ms"] for l in steps if l["rank"] == rank) for rank in (0, 1, 2)}
    assert max(step_ms.values()) < 1.2 * min(step_ms.values()), step_ms
    assert compute_ms[1] > 2 * max(compute_ms[0], compute_ms[2]), compute_ms
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


def test_a_rank_that_fails_inside_the_window_keeps_the_steps_it_profiled(write_recipe, tmp_path):
    """Rank 1 raises in its third step: its trace of step 2 is written before the failure is reported."""
    result = run_cli("train", str(write_recipe(RAISES_IN_RANK_1)), "-s", "mirrored", "--replicas", "2",
                     "--device", "cpu", "--steps", "8", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--profile", "2:5", "--json")
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]  # TrainingError: rank 1 raised
    profiled = [(line["rank"], line["start_step"], line["end_step"])
                for line in result.json_lines() if line["type"] == "profile"]
    assert (1, 2, 2) in profiled
    assert len(list((tmp_path / "ckpt" / "profile").glob("rank1.*.pt.trace.json"))) == 1


def test_a_run_resumed_past_the_window_profiles_nothing_and_says_so(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV)
    first = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--device", "cpu", "--steps", "4",
                    "--checkpoint-dir", str(tmp_path), "--json")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli("train", str(recipe), "-s", "mirrored", "--replicas", "2", "--device", "cpu", "--steps", "6",
                    "--checkpoint-dir", str(tmp_path), "--resume", "--profile", "2:3", "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    lines = again.json_lines()
    assert [line for line in lines if line["type"] == "profile"] == []  # no unasked-for step 5 profiled
    notes = [line["line"] for line in lines if line["type"] == "output" and "--profile" in line["line"]]
    assert notes == ["[distrun] --profile 2:3: this run starts at step 5, past the window; nothing profiled"]
    assert not (tmp_path / "profile").exists()
