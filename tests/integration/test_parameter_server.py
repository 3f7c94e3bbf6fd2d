"""`--strategy parameter-server` on this machine: the ps tasks and workers are local processes,
talking through real gloo pairs; the same code runs across hosts (tests/cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import REPO, run_cli
from tests.integration._recipes import PS_RECIPE

pytestmark = pytest.mark.usefixtures("warm_start")


EMBEDDING = str(REPO / "recipes" / "embedding.py")
SPLIT = ("--ps-tasks", "2", "--ps-partition-mb", "0.1")  # the 320 KB embedding is split by rows


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _train(*args: str) -> list[dict]:
    cut = args.index("--") if "--" in args else len(args)
    result = run_cli("train", *args[:cut], "--json", *args[cut:])
    assert result.returncode == 0, result.stderr[-3000:]
    return _lines(result.stdout)


def test_sync_rounds_with_one_worker_equal_one_device_with_the_embedding_split_across_two_ps(tmp_path: Path) -> None:
    lines = _train(EMBEDDING, "--strategy", "ps", "--replicas", "1", "--ps-sync", *SPLIT, "--steps", "30",
                   "--checkpoint-dir", str(tmp_path / "ps"))
    placement = [line["line"] for line in lines if line.get("type") == "output" and "[placement]" in line["line"]]
    assert any("ps0:" in p and "embedding.weight[0:2500]" in p for p in placement), placement
    assert any("ps1:" in p and "embedding.weight[2500:5000]" in p for p in placement), placement
    ps = {line["task"]: line for line in lines if line.get("type") == "ps"}
    assert ps[0]["params"] + ps[1]["params"] == 5000 * 16 + 16 * 2 + 2
    # Only the rows a batch looks up travel: far less than pulling the table every step.
    table_bytes = 5000 * 16 * 4
    assert ps[0]["bytes_out"] + ps[1]["bytes_out"] < 30 * table_bytes / 4
    _train(EMBEDDING, "--steps", "30", "--checkpoint-dir", str(tmp_path / "one"))
    a = torch.load(latest_checkpoint(tmp_path / "ps"), weights_only=True)
    b = torch.load(latest_checkpoint(tmp_path / "one"), weights_only=True)
    assert a["step"] == b["step"] == 30 and a["strategy"] == "parameter-server"
    for key, tensor in b["model"].items():
        assert torch.equal(a["model"][key], tensor), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert sorted(a["optimizer"]["state"]) == sorted(b["optimizer"]["state"]) == [0, 1, 2]
    for index, state in b["optimizer"]["state"].items():  # Adam's moments, gathered from both ps tasks
        for key, value in state.items():
            assert torch.equal(a["optimizer"]["state"][index][key], value), (index, key)


def test_a_ps_checkpoint_resumes_under_mirrored_and_the_reverse(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(EMBEDDING, "--strategy", "ps", *SPLIT, "--steps", "20", "--checkpoint-dir", str(ckpt))
    lines = _train(EMBEDDING, "--strategy", "mirrored", "--steps", "40", "--resume", "--checkpoint-dir", str(ckpt))
    steps = [line["step"] for line in lines if line.get("type") == "step"]
    assert min(steps) == 21 and lines[-1]["steps"] == 40
    lines = _train(EMBEDDING, "--strategy", "ps", *SPLIT, "--steps", "70", "--resume", "--checkpoint-dir", str(ckpt))
    steps = [line["step"] for line in lines if line.get("type") == "step"]
    assert min(steps) > 40 and lines[-1]["steps"] == 70
    assert torch.load(latest_checkpoint(ckpt), weights_only=True)["step"] == 70


def _pushes(lines: list[dict], rank: int) -> int:
    return max(line["pushes"] for line in lines if line.get("type") == "step" and line["rank"] == rank)


def test_max_staleness_holds_a_fast_worker_near_a_slow_one(tmp_path: Path) -> None:
    recipe = tmp_path / "ps_recipe.py"
    recipe.write_text(PS_RECIPE)
    slow = ("--", "--slow-rank", "1", "--sleep-s", "0.05")
    free = _train(str(recipe), "--strategy", "ps", "--steps", "120", *slow)
    assert _pushes(free, 0) > 3 * _pushes(free, 1), "without a bound the fast worker runs ahead"
    bounded = _train(str(recipe), "--strategy", "ps", "--steps", "120", "--max-staleness", "2", *slow)
    assert abs(_pushes(bounded, 0) - _pushes(bounded, 1)) <= 3
    assert bounded[-1]["steps"] == 120


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--strategy", "mirrored", "--ps-sync"), "--ps-sync is for --strategy parameter-server"),
        (("--strategy", "ps", "--ps-sync", "--max-staleness", "2"), "--ps-sync has no staleness"),
        (("--strategy", "ps", "--ps-tasks", "0"), "needs at least one ps task"),
        (("--strategy", "ps", "--max-staleness", "-1"), "--max-staleness: expected 0 or more"),
    ],
)
def test_bad_parameter_server_flags_are_one_line_errors(args: tuple[str, ...], message: str) -> None:
    result = run_cli("train", EMBEDDING, *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_parameter_server_needs_a_fit_style_recipe() -> None:
    result = run_cli("train", str(REPO / "recipes" / "custom_loop.py"), "--strategy", "ps")
    assert result.returncode == 2 and "trains fit-style recipes" in result.stderr, result.stderr


@pytest.mark.bench
def test_bench_straggler_reports_async_against_sync_and_the_bound() -> None:
    from distrun.bench.straggler import straggler_bound

    assert straggler_bound(3, 3) == pytest.approx(7 / 3)  # ((n-1) + 1/k) / (n/k)
    result = run_cli("bench", "straggler", "--replicas", "2", "--steps", "40", "--step-s", "0.01", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["bound"] == pytest.approx(straggler_bound(2, 3.0))
    assert [row["mode"] for row in report["rows"]] == ["sync", "async"]
    sync, asynchronous = report["rows"]
    assert sync["updates"] == 20 and asynchronous["updates"] == 40  # the same 40 batches: rounds of 2, or one each
    assert sync["batches_per_s"] > 0 and asynchronous["batches_per_s"] > 0
    assert report["ratio"] == pytest.approx(asynchronous["batches_per_s"] / sync["batches_per_s"])
    assert report["fraction_of_bound"] == pytest.approx(report["ratio"] / report["bound"])


def test_a_worker_dying_mid_round_does_not_hold_the_synchronous_rounds(tmp_path: Path) -> None:
    recipe = tmp_path / "ps_recipe.py"
    recipe.write_text(PS_RECIPE)
    lines = _train(str(recipe), "--strategy", "ps", "--ps-sync", "--steps", "60",
                   "--", "--die-rank", "1", "--die-at", "10", "--once", str(tmp_path / "died"))
    assert [line["returncode"] for line in lines if line.get("type") == "exited" and line["rank"] == 1] == [-9]
    assert any("[ps0] worker 1 lost" in line["line"] for line in lines if line.get("type") == "output")
    assert lines[-1]["status"] == "succeeded" and lines[-1]["steps"] == 60
    assert max(line["updates"] for line in lines if line.get("type") == "ps") == 60


def test_sync_rounds_with_two_workers_equal_mirrored_and_repeat_exactly(tmp_path: Path) -> None:
    """Two workers' mean gradient per round is the global batch's: mirrored's update, even on the
    uneven last batch; and rounds are summed in worker order, so a second run is bit for bit the same."""
    from tests.integration._recipes import EQUIV

    recipe = tmp_path / "equiv.py"
    recipe.write_text(EQUIV)
    common = ("--replicas", "2", "--epochs", "2", "--", "--samples", "99")
    _train(str(recipe), "--strategy", "mirrored", "--checkpoint-dir", str(tmp_path / "mirrored"), *common)
    for run in ("ps1", "ps2"):
        _train(str(recipe), "--strategy", "ps", "--ps-sync", "--checkpoint-dir", str(tmp_path / run), *common)
    mirrored, first, second = (torch.load(latest_checkpoint(tmp_path / run), weights_only=True)
                               for run in ("mirrored", "ps1", "ps2"))
    assert mirrored["step"] == first["step"] == 14
    for key, tensor in mirrored["model"].items():
        torch.testing.assert_close(first["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
        assert torch.equal(first["model"][key], second["model"][key]), key


def test_bf16_on_the_wire_halves_what_workers_push_and_the_ps_keeps_fp32(tmp_path: Path) -> None:
    """One worker in synchronous rounds: the same batches in the same order, so the runs
    differ only by what the wire rounds. Rounding the pulled parameters to bf16 changes each
    gradient a little, and Adam moves a parameter about lr a step whatever its gradient's size,
    so small steps may flip: the runs may part by a few lr (0.01), never by the 30 lr each moved."""
    runs = {}
    for compression in ("none", "bf16"):
        lines = _train(EMBEDDING, "--strategy", "ps", "--replicas", "1", "--ps-sync", *SPLIT, "--steps", "30",
                       "--compression", compression, "--checkpoint-dir", str(tmp_path / compression))
        assert lines[-1]["compression"] == compression
        # Each ps event carries its task's running total: the last one per task counts, not
        # their sum (how many events a run emits depends on its timing).
        totals: dict[int, int] = {}
        for line in lines:
            if line.get("type") == "ps":
                totals[line["rank"]] = max(totals.get(line["rank"], 0), line["bytes_in"])
        pushed = sum(totals.values())
        runs[compression] = (pushed, lines[-1]["final_loss"], torch.load(latest_checkpoint(tmp_path / compression),
                                                                           weights_only=True)["model"])
    (plain_bytes, plain_loss, plain), (wire_bytes, wire_loss, wire) = runs["none"], runs["bf16"]
    # Rows of 16 values cross in 32 bytes instead of 64, their 8-byte ids and the headers as they were.
    assert wire_bytes < 0.65 * plain_bytes
    assert all(tensor.dtype == torch.float32 for tensor in wire.values())  # the ps updated in fp32
    diff = max((wire[k] - plain[k]).abs().max().item() for k in plain)
    assert 0 < diff < 5 * 0.01
    assert wire_loss == pytest.approx(plain_loss, rel=0.01)


def test_powersgd_is_refused_for_parameter_server_pushes() -> None:
    result = run_cli("train", EMBEDDING, "-s", "ps", "--compression", "powersgd")
    assert result.returncode == 2 and "parameter-server pushes take --compression fp16|bf16" in result.stderr
