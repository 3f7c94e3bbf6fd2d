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
import re
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
        # The chained model's layers, drawn from the seed in its order (the blocks first) and named in it.
        blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                               for _ in range(ARGS.layers))
        self.first = nn.Sequential(nn.Linear(ARGS.inputs, width), nn.ReLU())
        self.blocks = blocks
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
    result = run_cli("plan", str(recipe), "--json", "--no-trials", "--device", "cpu", "-b", BATCH, "--", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    needs = [c["predicted_peak_mb"] for c in plan["candidates"] if c["layout"].startswith("mirrored x")]
    assert needs, plan["candidates"]
    # Said why: each prediction's parts add up to it, and the measured inputs it was made of are there.
    for candidate in plan["candidates"]:
        assert sum(candidate["step_parts_s"].values()) == pytest.approx(candidate["predicted_step_s"]), candidate
        assert sum(candidate["memory_parts_mb"].values()) == pytest.approx(candidate["predicted_peak_mb"], abs=0.5)
    profile, resources = plan["inputs"]["profile"], plan["inputs"]["resources"]
    # The probe's timed line, a fixed cost plus a cost per sample: a fast machine may not resolve the
    # slope over a few rows (a median 8-row step no slower than a 2-row one reads 0 per sample, all of
    # it fixed cost; CI's machine did), but the step it timed always costs something.
    assert profile["parameter_bytes"] > 0 and profile["compute_s_per_sample"] >= 0, profile
    assert profile["overhead_s"] + profile["probe_rows"] * profile["compute_s_per_sample"] > 0, profile
    assert resources["ranks"] == 2 and resources["budget_bytes"] > 0, resources
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
    """The checkpoint's parameters are ``reference``'s, in order (the unchained recipe builds the same
    layers in the same order from the same seed, under other names)."""
    model = load_checkpoint(latest_checkpoint(ckpt))["model"]
    assert len(model) == len(reference)
    for (key, tensor), (_, expected) in zip(model.items(), reference.items()):
        # Adam (lr 1e-4, 3 steps) divides each update by the gradient's own size: where a gradient is
        # near 0, a layout's other summation order can flip its update's sign (up to 2 lr a step). So
        # nearly every element is one-device's to 2e-6, and none is off by more than those flips.
        diff = (tensor - expected).abs()
        assert float(diff.max()) <= 6e-4, (key, float(diff.max()))
        assert float((diff > 2e-6).float().mean()) < 1e-4, (key, int((diff > 2e-6).sum()), diff.numel())


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
    # The decision's block (a trial stopped at its deadline says so on a line of its own: a slow
    # machine's may be; a trial that failed is not left out).
    block = [line for line in result.stderr.splitlines() if line.startswith("auto: ")
             and not (line.startswith("auto: the trial of ") and "; it was stopped, and the model's" in line)]
    assert len(block) == 1 and block[0].startswith("auto: mirrored x2: predicted peak "), result.stderr[-2000:]
    assert plan["decide_s"] <= 30 and plan["measured_peak_mb"] > 0 and plan["measured_step_s"] > 0
    _same_parameters(tmp_path / "auto", _one_device(unchained, tmp_path / "one", *args))


@pytest.fixture(scope="module")
def big_one_device(tmp_path_factory) -> dict:
    """One-device's parameters of the big model after the tests' steps: both budget tests' reference."""
    return _one_device(PIPELINE_RECIPE, tmp_path_factory.mktemp("one"), *BIG)


@pytest.fixture(scope="module")
def big_need_mb() -> float:
    """The big model's smallest mirrored need, as the planner predicts it: the same model whether
    written as a chain or not, so both budget tests share one probe."""
    return _smallest_mirrored_need_mb(PIPELINE_RECIPE, *BIG)


def test_a_budget_below_mirrored_chooses_a_pipeline_that_runs_within_it(big_need_mb, big_one_device, memory_cgroup,
                                                                          tmp_path):
    _limit(memory_cgroup, 2 * big_need_mb + CLIENT_MB)
    summary = _auto_in(memory_cgroup, PIPELINE_RECIPE, tmp_path / "auto", tmp_path / "home", *BIG)
    plan = summary["plan"]
    assert plan["chosen"]["parallel"]["pp"] == 2, plan["chosen"]
    mirrored = next(c for c in plan["candidates"] if c["layout"] == "mirrored x2")
    # The verdict rounds the exact bytes, the JSON a tenth of a MB: 1092.54 reads "1,093" in one, 1092.5 in the other.
    said = re.fullmatch(r"needs ([\d,]+) MB a rank, over the ([\d,]+) MB usable of a ([\d,]+) MB budget",
                        mirrored["verdict"])
    assert said, mirrored["verdict"]
    need_mb, usable_mb, budget_mb = (float(n.replace(",", "")) for n in said.groups())
    assert abs(need_mb - mirrored["predicted_peak_mb"]) <= 1 and abs(budget_mb - plan["budget_mb"]) <= 1, mirrored
    assert need_mb > usable_mb, mirrored
    assert plan["predicted_peak_mb"] <= 0.9 * plan["budget_mb"]
    oom = (memory_cgroup / "memory.oom_control").read_text()
    assert "oom_kill 0" in oom or "oom_kill" not in oom, oom  # it ran within the cgroup's limit
    written = load_checkpoint(latest_checkpoint(tmp_path / "auto"))
    assert written["mesh"]["pp"] == 2 and written["layout"]["accumulate"] == plan["chosen"]["training"]["accumulate"]
    _same_parameters(tmp_path / "auto", big_one_device)


def test_a_model_without_a_chain_under_the_same_budget_is_sharded(unchained, big_need_mb, big_one_device, memory_cgroup,
                                                                   tmp_path):
    _limit(memory_cgroup, 2 * big_need_mb + CLIENT_MB)
    summary = _auto_in(memory_cgroup, unchained, tmp_path / "auto", tmp_path / "home", *BIG)
    plan = summary["plan"]
    assert plan["chosen"]["strategy"]["name"] == "sharded" and plan["chosen"]["parallel"]["pp"] == 1, plan["chosen"]
    assert not any("--pp" in c["layout"] for c in plan["candidates"])  # nothing to cut, nothing offered
    _same_parameters(tmp_path / "auto", big_one_device)



def test_trials_run_the_layouts_the_model_cannot_tell_apart_and_keep_the_faster(unchained):
    """A step of milliseconds is mostly what the model cannot see: the best layout and the best of
    another kind each run for real for a few steps, and the faster measured one is chosen, its
    measured step the plan's prediction (called directly, so the 30 s budget the probe shares does
    not decide whether the trials run)."""
    from distrun.cli._auto_trials import SHORT_STEP_S, time_near, trial_flags
    from distrun.cli._spec import build_spec
    from distrun.planner.choose import decide
    from distrun.planner.cost import Link, ModelProfile, Resources

    mb = 10**6
    profile = ModelProfile(parameter_bytes=mb, gradient_bytes=mb, optimizer_bytes=2 * mb, units=2, largest_unit_bytes=mb,
                           compute_s_per_sample=1e-6, forward_s_per_sample=3e-7, activation_bytes_per_sample=1000,
                           checkpointed_activation_bytes_per_sample=100, base_bytes=300 * mb)
    resources = Resources(ranks=2, hosts=1, budget_bytes=10_000 * mb, within_host=Link(1e9, 1e-5))
    decision = decide(profile, resources, int(BATCH))
    assert decision.chosen.step_s < SHORT_STEP_S
    base = {"recipe": unchained, "recipe_args": ("--width", "8", "--layers", "2", "--samples", "512"),
            "device": "cpu", "global_batch_size": int(BATCH), "seed": None}
    ran: list[tuple[str, int]] = []

    def make_spec(layout, steps):
        ran.append((layout.describe(), steps))
        return build_spec(**trial_flags(base, layout, steps))

    retimed, spent_s = time_near(decision, 0.0, make_spec, budget_s=300)
    timed = {p.layout.describe(): p.timed_step_s for p, _ in retimed.ranked if p.timed_step_s is not None}
    assert sorted(timed) == sorted(name for name, _ in ran) == ["mirrored x2", "sharded x2"], (ran, timed)
    assert all(steps >= 4 for _, steps in ran) and all(step_s > 0 for step_s in timed.values())
    assert retimed.chosen.timed_step_s == min(timed.values())
    assert retimed.chosen.expected_step_s == retimed.chosen.timed_step_s
    loser = next(verdict for p, verdict in retimed.ranked if p.timed_step_s is not None and verdict != "chosen")
    assert loser.startswith("timed at "), loser
    assert spent_s < 60

    # A trial that fails takes its layout out: sharded here runs a recipe that raises.
    broken = unchained.parent / "broken.py"
    broken.write_text(unchained.read_text().replace("def model() -> nn.Module:",
                                                    "def model() -> nn.Module:\n    raise RuntimeError('no sharded')"))
    said: list[str] = []
    after, _ = time_near(decision, 0.0, lambda layout, steps: build_spec(**trial_flags(
        {**base, "recipe": broken if layout.strategy == "sharded" else unchained}, layout, steps)), said.append,
        budget_s=300)
    assert after.chosen.layout.describe() == "mirrored x2" and after.chosen.timed_step_s > 0
    verdicts = {p.layout.describe(): verdict for p, verdict in after.ranked}
    assert verdicts["sharded x2"].startswith("failed in its trial: ") and "no sharded" in verdicts["sharded x2"]
    assert [line for line in said if line.startswith("auto: the trial of sharded x2 failed: ")], said


def test_a_probe_process_that_dies_is_named_at_once(tmp_path):
    """A peer of the probe killed (as the OOM killer would) ends the probe with its signal named, not
    with gloo's timeout of the processes that waited for it a minute later."""
    recipe = tmp_path / "dies.py"
    recipe.write_text('''import os, signal

import torch
import torch.distributed as dist


def model():
    return torch.nn.Linear(4, 4)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def loss(outputs, batch):
    return outputs.pow(2).mean()


def train_data(ctx):
    return torch.utils.data.TensorDataset(torch.zeros(64, 4))


def forward(model, batch):
    if dist.is_initialized() and dist.get_rank() == 1:  # the second probe process only
        os.kill(os.getpid(), signal.SIGKILL)
    return model(batch[0])
''')
    result = run_cli("plan", str(recipe), "--device", "cpu", "-b", "8", "--no-trials")
    assert result.returncode == 3, result.stderr[-2000:]
    assert "--strategy auto's probe was killed by signal 9 (the out-of-memory killer?)" in result.stderr, result.stderr
    assert "Timed out" not in result.stderr
