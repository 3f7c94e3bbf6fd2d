"""`--strategy parameter-server` on namespace hosts: h1 runs two workers (rank 0 the chief), h2 the ps task.

Worker-to-ps traffic crosses the bridge between namespaces (gloo pairs on the
interface that routes to the chief), the ps and the chief are different hosts,
and faults are real SIGKILLs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.cluster.conftest import Lab, brought_up, json_lines, lab_cli, shaped_lab, training_pids
from tests.conftest import REPO, run_cli
from tests.integration._recipes import PS_RECIPE


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One lab for the module's two-host tests: they kill ranks, never servers."""
    with shaped_lab(tmp_path_factory.mktemp("ps-lab"), ("h1", "h2")) as made:
        yield made


@pytest.fixture(scope="module")
def ps_cluster(lab: Lab) -> Iterator[Path]:
    with brought_up(lab, {"h1": {"roles": "[chief, worker]", "slots": "2"}, "h2": {"roles": "[ps]"}}, "ps") as path:
        yield path


def _recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "code" / "ps_recipe.py"
    recipe.parent.mkdir(exist_ok=True)
    recipe.write_text(PS_RECIPE)
    return recipe


def _losses(lines: list[dict], rank: int) -> list[float]:
    return [line["loss"] for line in lines if line.get("type") == "step" and line["rank"] == rank and line["loss"]]


def _said(lines: list[dict], text: str) -> list[dict]:
    return [line for line in lines if line.get("type") == "output" and text in line["line"]]


def test_two_workers_one_ps_a_worker_killed_then_one_that_rejoins(lab: Lab, ps_cluster: Path, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)
    # A worker SIGKILLed at its 15th step: the job goes on without it and still applies 200 updates.
    # --sleep-s: the chief's 200 steps take 6 s or more. Unslowed, they once ended the job (and its store)
    # before a loaded host's rank 1 had opened its channels: rank 1 failed peer-lost, never killed.
    run = lab_cli(lab, "train", str(recipe), "--cluster", str(ps_cluster), "--strategy", "ps", "--json",
                  "--steps", "200", "--", "--die-rank", "1", "--die-at", "15", "--once", str(tmp_path / "died"),
                  "--sleep-s", "0.03")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = json_lines(run)
    assert lines[0]["world_size"] == 3 and lines[0]["hosts"] == [lab.hosts["h1"][1], lab.hosts["h2"][1]]
    started = {line["rank"]: line for line in lines if line.get("type") == "started"}
    assert sorted(started) == [0, 1, 2]
    assert _said(lines, "[placement] ps0:"), "the chief shows the placement"
    rank1 = [line for line in lines if line.get("rank") == 1 and line.get("type") in ("error", "exited", "output")]
    # The message is whole (pytest cuts a list's repr): rank 1's error and output, then the ps's lines.
    assert [line["returncode"] for line in rank1 if line["type"] == "exited"] == [-9], "\n".join(
        [json.dumps(line) for line in rank1 if line["type"] == "error"]
        + [line["line"] for line in rank1[:15] if "line" in line]
        + [line["line"] for line in _said(lines, "[ps0]")])
    assert _said(lines, "rank 1 lost; the job goes on without it")
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["status"] == "succeeded" and summary["steps"] == 200
    assert summary["ranks_lost"] == [1], summary  # named from the host's result, not "succeeded" alone
    ps = [line for line in lines if line.get("type") == "ps"]
    assert ps[-1]["updates"] == 200 and ps[-1]["params"] == 8 * 32 + 32 + 32 + 1
    assert ps[-1]["bytes_in"] > 0 and ps[-1]["bytes_out"] > 0
    chief = _losses(lines, 0)
    assert chief[-1] < chief[0] / 4, chief  # the chief trained on alone

    # With --max-restarts the lost worker is started again and joins the running job.
    (tmp_path / "died").unlink()
    run = lab_cli(lab, "train", str(recipe), "--cluster", str(ps_cluster), "--strategy", "ps", "--json",
                  "--steps", "600", "--max-restarts", "1",  # long enough for the restarted worker on a busy CI host
                  "--", "--die-rank", "1", "--die-at", "15", "--once", str(tmp_path / "died"),
                  "--sleep-s", "0.01")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = json_lines(run)
    assert _said(lines, "rank 1 lost; starting it again (1/1)")
    assert len(_said(lines, "[ps0] worker 1 joined")) == 2
    second = [i for i, line in enumerate(lines) if line.get("type") == "started" and line["rank"] == 1][1]
    after = [line for line in lines[second:] if line.get("type") == "step" and line["rank"] == 1]
    assert after and after[-1]["pushes"] > 1, "the rejoined worker pushed updates"
    assert lines[-1]["status"] == "succeeded" and lines[-1]["steps"] == 600 and lines[-1]["restarts"] == 0
    assert lines[-1]["ranks_lost"] == [], lines[-1]  # it came back
    assert training_pids(lab) == []


def test_a_killed_ps_task_restarts_the_job_from_its_checkpoint(lab: Lab, ps_cluster: Path, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)
    ckpt = tmp_path / "ckpt"
    argv = ["ip", "netns", "exec", lab.client_ns, sys.executable, "-m", "distrun", "train", str(recipe),
            "--cluster", str(ps_cluster), "--strategy", "ps", "--json", "--steps", "400", "--max-restarts", "1",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50", "--", "--sleep-s", "0.01"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=lab.root)
    lines: list[dict] = []
    killed = None
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            if not raw.startswith("{"):
                continue
            line = json.loads(raw)
            lines.append(line)
            if killed is None and line.get("type") == "checkpoint" and line["step"] >= 100:
                ps_pid = next(l["pid"] for l in lines if l.get("type") == "started" and l["rank"] == 2)
                os.kill(ps_pid, signal.SIGKILL)
                killed = line["step"]
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read() if proc.stderr else ""
    assert killed is not None, stderr[-3000:]
    assert proc.returncode == 0, stderr[-3000:]
    assert _said(lines, "restarting every rank (1/1) from the newest checkpoint")
    summary = lines[-1]
    assert summary["status"] == "succeeded" and summary["restarts"] == 1 and summary["steps"] == 400
    # The second attempt resumed where a checkpoint left off, not from step 0.
    restarted = next(i for i, l in enumerate(lines) if l.get("type") == "output" and "restarting every rank" in l["line"])
    first_steps = [l["step"] for l in lines[restarted:] if l.get("type") == "step" and l["rank"] == 0]
    assert first_steps and first_steps[0] > killed - 50
    final = torch.load(latest_checkpoint(ckpt), weights_only=True)
    assert final["step"] == 400 and final["strategy"] == "parameter-server"


def test_the_hybrid_keeps_its_table_on_the_ps_host_and_a_lost_dense_rank_rejoins(lab3: Lab, tmp_path: Path) -> None:
    """``-s multi-worker --embeddings ps --elastic 1:2`` over two worker hosts and a ps host (issue 51):
    the dense layers' DDP across h1 and h2, the large table on h3's ps task, rows crossing the bridge,
    one update a step. h2's rank is SIGKILLed between its pull and its push of a step's rows: h1
    finishes that step alone, h2's rank is started again and rejoins, healed by h1, while h3's ps task
    keeps the table (never restarted). The checkpoint comes home with the table in it, as one
    device's run of the same steps. (One job for what two tests ran: the suite's time.)"""
    from tests.integration.test_hybrid_elastic import RECIPE

    roles = {"h1": {"roles": "[chief, worker]", "slots": "1"}, "h2": {"roles": "[worker]", "slots": "1"},
             "h3": {"roles": "[ps]"}}
    code = tmp_path / "code"
    code.mkdir()
    recipe = code / "recommender.py"
    recipe.write_text(RECIPE.replace("if task == 1:", "if task == 0:"))  # one ps task here: its push
    with brought_up(lab3, roles, "psel") as path:
        run = lab_cli(lab3, "train", str(recipe), "--cluster", str(path), "--strategy", "multi-worker",
                      "--embeddings", "ps", "--ps-partition-mb", "1", "--elastic", "1:2", "--steps", "40", "--json",
                      "--checkpoint-dir", str(tmp_path / "el"), "--", "--die-at", "8", "--sleep-s", "0.2",
                      timeout=300)
        # Room for a host added later is one line: it would be placed after the ps task's rank.
        refused = lab_cli(lab3, "train", str(recipe), "--cluster", str(path), "--strategy", "multi-worker",
                          "--embeddings", "ps", "--elastic", "1:3", "--steps", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = json_lines(run)
    h1, h2 = lab3.hosts["h1"][1], lab3.hosts["h2"][1]
    assert lines[0]["world_size"] == 3 and lines[0]["hosts"][:2] == [h1, h2], lines[0]
    placement = [line["line"] for line in _said(lines, "[placement]")]
    assert any("ps0:" in p and "users.weight[0:20000]" in p for p in placement), placement
    ps = [line for line in lines if line.get("type") == "ps"]
    assert ps and ps[-1]["updates"] == 40 and ps[-1]["bytes_in"] > 0  # one update a step, through the loss
    changes = [line for line in lines if line.get("type") == "membership"]
    assert [c["world_size"] for c in changes] == [1, 2], changes
    assert changes[0]["left"] and changes[0]["left"][0].startswith(f"rank 1 on {h2}") and \
        changes[1]["joined"] == [f"rank 1 on {h2}"], changes
    ps_starts = [line for line in lines if line.get("type") == "started" and line["rank"] == 2]
    assert len(ps_starts) == 1, ps_starts  # the ps task was never restarted: it kept the table
    summary = lines[-1]
    assert summary["status"] == "succeeded" and summary["steps"] == 40 and summary["steps_lost"] == 0, summary
    assert 0 < summary["embedding_bytes_per_step"] < 20_000 * 16 * 4  # rows, never the whole table
    local = run_cli("train", str(recipe), "--strategy", "one-device", "--steps", "40", "--json",
                    "--checkpoint-dir", str(tmp_path / "one"))
    assert local.returncode == 0, local.stderr[-2000:]
    remote = torch.load(latest_checkpoint(lab3.root / "distrun-results" / lines[0]["job"]), weights_only=True)
    one = torch.load(latest_checkpoint(tmp_path / "one"), weights_only=True)
    assert remote["step"] == one["step"] == 40 and list(remote["model"]) == list(one["model"])
    for key, tensor in one["model"].items():
        torch.testing.assert_close(remote["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    assert refused.returncode == 2 and "--elastic 1:3 with --embeddings ps: on a cluster the job keeps the 2 " \
        "worker host(s) it starts with" in refused.stderr, refused.stderr[-2000:]
    assert len([line for line in refused.stderr.splitlines() if line.strip()]) == 1, refused.stderr


def test_sync_rounds_across_hosts_equal_one_device_and_the_checkpoint_resumes_under_mirrored(
        lab3: Lab, tmp_path: Path) -> None:
    """One worker host, two ps hosts: the embedding is split by rows across h2 and h3."""
    roles = {"h1": {"roles": "[chief, worker]", "slots": "1"}, "h2": {"roles": "[ps]"}, "h3": {"roles": "[ps]"}}
    with brought_up(lab3, roles, "ps2") as path:
        code = tmp_path / "code"
        code.mkdir()
        recipe = code / "embedding.py"
        recipe.write_text((REPO / "recipes" / "embedding.py").read_text())
        run = lab_cli(lab3, "train", str(recipe), "--cluster", str(path), "--strategy", "ps", "--ps-sync",
                      "--ps-partition-mb", "0.1", "--steps", "30", "--json", "--checkpoint-dir", str(tmp_path / "ps"))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = json_lines(run)
    assert lines[0]["world_size"] == 3
    placement = [line["line"] for line in lines if line.get("type") == "output" and "[placement]" in line["line"]]
    assert any("embedding.weight[0:2500]" in p for p in placement)
    assert any("embedding.weight[2500:5000]" in p for p in placement)
    ps = {line["task"]: line for line in lines if line.get("type") == "ps"}
    assert set(ps) == {0, 1} and ps[0]["updates"] == ps[1]["updates"] == 30
    local = run_cli("train", str(recipe), "--steps", "30", "--json", "--checkpoint-dir", str(tmp_path / "one"))
    assert local.returncode == 0, local.stderr[-2000:]
    home = lab3.root / "distrun-results" / lines[0]["job"]
    remote = torch.load(latest_checkpoint(home), weights_only=True)  # the checkpoint came home over SFTP
    one = torch.load(latest_checkpoint(tmp_path / "one"), weights_only=True)
    assert remote["step"] == one["step"] == 30
    for key, tensor in one["model"].items():
        assert torch.equal(remote["model"][key], tensor), key
    for index, state in one["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(remote["optimizer"]["state"][index][key], value), (index, key)
    resumed = run_cli("train", str(recipe), "--strategy", "mirrored", "--steps", "45", "--resume", "--json",
                      "--checkpoint-dir", str(home))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [json.loads(l)["step"] for l in resumed.stdout.splitlines() if l.startswith('{"type":"step"')]
    assert min(steps) == 31 and json.loads(resumed.stdout.splitlines()[-1])["steps"] == 45


def test_an_evaluator_host_evaluates_parameter_server_checkpoints(lab3: Lab, tmp_path: Path) -> None:
    roles = {"h1": {"roles": "[chief, worker]", "slots": "2"}, "h2": {"roles": "[ps]"}, "h3": {"roles": "[evaluator]"}}
    code = tmp_path / "code"
    code.mkdir()
    recipe = code / "embedding.py"
    recipe.write_text((REPO / "recipes" / "embedding.py").read_text())
    with brought_up(lab3, roles, "pse") as path:
        run = lab_cli(lab3, "train", str(recipe), "--cluster", str(path), "--strategy", "ps", "--steps", "40",
                      "--checkpoint-every", "20", "--json", "--checkpoint-dir", str(tmp_path / "ck"))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = json_lines(run)
    assert lines[0]["world_size"] == 3 and lab3.hosts["h3"][1] not in lines[0]["hosts"]
    evaluated = [line for line in lines if line.get("type") == "eval" and line["rank"] == -2]
    assert evaluated and evaluated[-1]["step"] == 40 and 0 < evaluated[-1]["metrics"]["loss"] < 10
    assert lines[-1]["status"] == "succeeded" and lines[-1]["evaluator_step"] == 40
