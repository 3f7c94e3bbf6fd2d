"""``--strategy auto`` (issue 48): three inputs, three choices, each ending with one-device's
parameters, and each run inside the budget the planner read.

- a small model with memory to spare: mirrored x2 (nothing to gain from the others);
- a 34M-parameter Adam model at a small batch, in a memory cgroup below every mirrored layout's
  predicted need: a pipeline (its stages split the replicated state; sharded's all-gathers of
  the parameters cost far more on gloo, as the probe measures);
- the same model written without a chain (no nn.Sequential, no pp_chain), in the same kind of
  cgroup: sharded.

The cgroup's limit comes from the planner's own predictions for the model (``distrun plan
--json`` outside the cgroup): twice the smallest mirrored need, so that no mirrored layout fits
90% of a rank's share. The job then runs in that cgroup: a layout the model says fits but the
kernel kills would fail the test (exit 4). Each test's process joins its cgroup before
``distrun`` starts, and uses its own DISTRUN_HOME, so no warm server forks ranks outside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint, load_checkpoint
from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("warm_start")]

PIPELINE_RECIPE = REPO / "distrun" / "bench" / "_pipeline_recipe.py"
#: A 34M-parameter Adam model at a small batch: its state, not its activations, decides memory
#: (no accumulation or checkpointing brings mirrored under the budget), and gloo's all-gathers of
#: it make sharded the slowest layout where another fits.
BIG = ("--width", "1024", "--layers", "4", "--samples", "512")
BATCH = "8"
#: A rank's footprint and the client beside the ranks, in the cgroup: what the limit adds to the ranks' share.
CLIENT_MB = 100

#: The pipeline recipe's model, but a plain nn.Module with a ModuleList: nothing --pp can cut.
UNCHAINED = PIPELINE_RECIPE.read_text().replace('''def model() -> nn.Module:
    width = ARGS.width
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
              for _ in range(ARGS.layers)]
    return nn.Sequential(nn.Linear(ARGS.inputs, width), nn.ReLU(), *blocks, nn.Linear(width, _CLASSES))''', '''class Net(nn.Module):
    def __init__(self):
        super().__init__()
        width = ARGS.width
        self.first = nn.Sequential(nn.Linear(ARGS.inputs, width), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(ARGS.layers))
        self.head = nn.Linear(width, _CLASSES)

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model() -> nn.Module:
    return Net()''')


@pytest.fixture(scope="module")
def unchained(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto") / "unchained.py"
    assert "class Net" in UNCHAINED  # the replacement above found the model
    path.write_text(UNCHAINED)
    return path


@pytest.fixture
def memory_cgroup():
    """A v1 memory cgroup of this test's own (its limit set by the test); removed after it."""
    root = Path("/sys/fs/cgroup/memory")
    assert (root / "cgroup.procs").is_file(), \
        "this test needs the v1 memory controller at /sys/fs/cgroup/memory (it makes a cgroup there)"
    group = root / f"distrun-test-auto-{os.getpid()}"
    group.mkdir(exist_ok=True)
    yield group
    for _ in range(50):  # the job's processes are gone once it ends; an rmdir may race their exit
        try:
            group.rmdir()
            break
        except OSError:
            subprocess.run(["sleep", "0.1"])


def _limit(group: Path, megabytes: float) -> None:
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):  # no swap: the OOM killer it is
        if (group / name).is_file():
            (group / name).write_text(str(int(megabytes * 10**6)))


def _smallest_mirrored_need_mb(recipe: Path, *args: str) -> float:
    """The planner's own smallest predicted peak of a data-parallel layout (any accumulation or
    checkpointing), outside any cgroup."""
    result = run_cli("plan", str(recipe), "--json", "--device", "cpu", "-b", BATCH, "--", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    needs = [c["predicted_peak_mb"] for c in plan["candidates"] if c["layout"].startswith("mirrored x")]
    assert needs, plan["candidates"]
    return min(needs)


def _auto_in(group: Path, recipe: Path, ckpt: Path, home: Path, *args: str) -> dict:
    command = "echo $$ > \"$1\"/cgroup.procs && shift && exec \"$@\""
    proc = subprocess.run(
        ["sh", "-c", command, "sh", str(group), sys.executable, "-m", "distrun", "train", str(recipe), "-s", "auto",
         "--device", "cpu", "--json", "--steps", "3", "-b", BATCH, "--checkpoint-dir", str(ckpt), "--", *args],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "DISTRUN_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _one_device(recipe: Path, ckpt: Path, *args: str) -> dict:
    result = run_cli("train", str(recipe), "-s", "one-device", "--device", "cpu", "--steps", "3", "-b", BATCH,
                     "--checkpoint-dir", str(ckpt), "--", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return load_checkpoint(latest_checkpoint(ckpt))["model"]


def _same_parameters(ckpt: Path, reference: dict) -> None:
    model = load_checkpoint(latest_checkpoint(ckpt))["model"]
    assert set(model) == set(reference)
    for key, tensor in reference.items():
        torch.testing.assert_close(model[key], tensor, rtol=0, atol=2e-6, msg=key)


def test_memory_to_spare_keeps_mirrored(unchained, tmp_path):
    """A small model without a chain: mirrored against sharded, whose all-gathers a unit buy nothing
    here. (With a chain, a pipeline's predicted fixed costs on so small a model are within the
    probe's noise of mirrored's: the cgroup test below is the pipeline's.)"""
    args = ("--width", "8", "--layers", "2", "--samples", "512")
    result = run_cli("train", str(unchained), "-s", "auto", "--device", "cpu", "--json", "--steps", "3",
                     "-b", BATCH, "--checkpoint-dir", str(tmp_path / "auto"), "--", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = result.summary["plan"]
    assert plan["chosen"]["strategy"] == {"name": "mirrored", "replicas": 2}, plan["chosen"]
    assert plan["chosen"]["parallel"]["pp"] == 1 and plan["chosen"]["training"]["accumulate"] == 1
    assert result.summary["strategy"] == "mirrored" and result.summary["replicas"] == 2
    block = [line for line in result.stderr.splitlines() if line.startswith("auto: ")]
    assert len(block) == 1 and block[0].startswith("auto: mirrored x2: predicted peak "), result.stderr[-2000:]
    assert plan["decide_s"] <= 30 and plan["measured_peak_mb"] > 0 and plan["measured_step_s"] > 0
    _same_parameters(tmp_path / "auto", _one_device(unchained, tmp_path / "one", *args))


def test_a_budget_below_mirrored_chooses_a_pipeline_that_runs_within_it(memory_cgroup, tmp_path):
    need = _smallest_mirrored_need_mb(PIPELINE_RECIPE, *BIG)
    _limit(memory_cgroup, 2 * need + CLIENT_MB)
    summary = _auto_in(memory_cgroup, PIPELINE_RECIPE, tmp_path / "auto", tmp_path / "home", *BIG)
    plan = summary["plan"]
    assert plan["chosen"]["parallel"]["pp"] == 2, plan["chosen"]
    mirrored = next(c for c in plan["candidates"] if c["layout"] == "mirrored x2")
    assert mirrored["verdict"].startswith(f"needs {mirrored['predicted_peak_mb']:,.0f} MB a rank, the budget is ")
    assert plan["predicted_peak_mb"] <= 0.9 * plan["budget_mb"]
    oom = (memory_cgroup / "memory.oom_control").read_text()
    assert "oom_kill 0" in oom or "oom_kill" not in oom, oom  # it ran within the cgroup's limit
    written = load_checkpoint(latest_checkpoint(tmp_path / "auto"))
    assert written["mesh"]["pp"] == 2 and written["layout"]["accumulate"] == plan["chosen"]["training"]["accumulate"]
    _same_parameters(tmp_path / "auto", _one_device(PIPELINE_RECIPE, tmp_path / "one", *BIG))


def test_a_model_without_a_chain_under_the_same_budget_is_sharded(unchained, memory_cgroup, tmp_path):
    need = _smallest_mirrored_need_mb(unchained, *BIG)
    _limit(memory_cgroup, 2 * need + CLIENT_MB)
    summary = _auto_in(memory_cgroup, unchained, tmp_path / "auto", tmp_path / "home", *BIG)
    plan = summary["plan"]
    assert plan["chosen"]["strategy"]["name"] == "sharded" and plan["chosen"]["parallel"]["pp"] == 1, plan["chosen"]
    assert not any("--pp" in c["layout"] for c in plan["candidates"])  # nothing to cut, nothing offered
    _same_parameters(tmp_path / "auto", _one_device(unchained, tmp_path / "one", *BIG))

