"""`distrun train --cluster`: code shipped from the client, ranks on two namespace hosts, gloo between them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests._sshd import cluster_yaml
from tests.cluster.conftest import Lab
from tests.cluster.test_netns_hosts import _distrun_pids
from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV


def _cli(lab: Lab, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", lab.client_ns, sys.executable, "-m", "distrun", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=lab.root)  # results come home here


def _json_lines(proc: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def cluster(lab: Lab) -> Path:
    hosts = [{"address": lab.hosts["h1"][1], "roles": "[chief, worker]"},
             {"address": lab.hosts["h2"][1], "roles": "[worker]"}]
    path = lab.root / "lab.yaml"
    path.write_text(cluster_yaml(lab.keys, hosts, workdir=lab.workdir, name="lab"))
    up = _cli(lab, "up", str(path), "--json")
    assert up.returncode == 0, up.stdout + up.stderr
    yield path
    _cli(lab, "down", str(path))


def test_multi_worker_on_two_hosts_matches_one_device(lab: Lab, cluster: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "code" / "equiv.py"
    recipe.parent.mkdir()
    recipe.write_text(EQUIV)
    local = run_cli("train", str(recipe), "--json", "--checkpoint-dir", str(tmp_path / "one"), "--epochs", "2",
                    "--", "--samples", "99")
    assert local.returncode == 0, local.stderr[-2000:]

    remote = _cli(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                  "--checkpoint-dir", str(tmp_path / "mw"), "--epochs", "2", "--", "--samples", "99")
    assert remote.returncode == 0, remote.stdout[-3000:] + remote.stderr[-3000:]
    lines = _json_lines(remote)
    job = lines[0]
    assert job["type"] == "job" and job["world_size"] == 2 and job["hosts"] == [lab.hosts["h1"][1], lab.hosts["h2"][1]]
    assert sorted(job["bundle_sent_to"]) == sorted(job["hosts"])
    started = [line for line in lines if line.get("type") == "started"]
    assert sorted(line["rank"] for line in started) == [0, 1] and {line["world_size"] for line in started} == {2}
    base = torch.load(latest_checkpoint(tmp_path / "one"), weights_only=True)
    multi = torch.load(latest_checkpoint(tmp_path / "mw"), weights_only=True)
    assert multi["step"] == base["step"] == 14 and multi["strategy"] == "multi-worker"
    for key, tensor in base["model"].items():
        torch.testing.assert_close(multi["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)
    assert lines[-1]["type"] == "summary" and lines[-1]["status"] == "succeeded"

    # Results come home: the newest checkpoint, read from rank 0's host over SFTP, and the summary.
    results = next(line for line in lines if line.get("type") == "results")
    home = lab.root / "distrun-results" / job["job"]
    assert results["dir"] == str(home) and results["checkpoint"] == str(home / "ckpt-000000014.pt")
    assert (home / "ckpt-000000014.pt").read_bytes() == (tmp_path / "mw" / "ckpt-000000014.pt").read_bytes()
    assert json.loads((home / "summary.json").read_text())["status"] == "succeeded"
    pulled = _cli(lab, "pull", job["job"], "--cluster", str(cluster), "--to", str(tmp_path / "pulled"))
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()) == tmp_path / "pulled" / job["job"] / "ckpt-000000014.pt"

    # The same code again: no host is sent the bundle a second time.
    again = _cli(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                 "--steps", "2", "--", "--samples", "99")
    assert again.returncode == 0, again.stderr[-2000:]
    assert _json_lines(again)[0]["bundle_sent_to"] == []
    for ns, _address in lab.hosts.values():
        training = [pid for pid in _distrun_pids(lab, ns) if "distrun.runtime" in " ".join(_cmdline(pid))]
        assert training == []


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


def test_an_edit_runs_on_the_next_try_and_plain_scripts_run_unchanged(lab: Lab, cluster: Path, tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper.py").write_text("GREETING = 'first'\n")
    script = code / "script.py"
    script.write_text((REPO / "recipes" / "torchrun_script.py").read_text().replace(
        "    print(f\"rank {rank}", "    import helper\n    print(helper.GREETING, os.environ['MASTER_ADDR'])\n"
                                  "    print(f\"rank {rank}"))
    first = _cli(lab, "train", str(script), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                 "--", "--steps", "5")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    output = [line["line"] for line in _json_lines(first) if line.get("type") == "output"]
    assert {line.split(":")[0] for line in output if line.startswith("rank ")} == {"rank 0 of 2", "rank 1 of 2"}
    assert output.count(f"first {lab.hosts['h1'][1]}") == 2  # both hosts reach the chief's address

    (code / "helper.py").write_text("GREETING = 'second'\n")  # edit a file beside the script
    second = _cli(lab, "train", str(script), "--cluster", str(cluster), "--strategy", "multi-worker", "--json",
                  "--", "--steps", "5")
    assert second.returncode == 0, second.stderr[-3000:]
    lines = _json_lines(second)
    assert len(lines[0]["bundle_sent_to"]) == 2  # changed content, new bundle
    assert [line["line"] for line in lines if line.get("type") == "output"].count(f"second {lab.hosts['h1'][1]}") == 2


def test_a_failing_rank_on_one_host_stops_every_host(lab: Lab, cluster: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "fails.py"
    recipe.write_text(EQUIV + "\n\nimport os\n_loss = loss\n\ndef loss(outputs, batch):\n"
                      "    import time\n    time.sleep(0.02)\n"
                      "    os.environ['N'] = str(int(os.environ.get('N', '0')) + 1)\n"
                      "    if int(os.environ['RANK']) == 1 and int(os.environ['N']) == 5:\n"
                      "        import sys\n"
                      "        print('about to fail: disk full?', file=sys.stderr, flush=True)\n"
                      "        raise ValueError('boom on the second host')\n"
                      "    return _loss(outputs, batch)\n")
    t0 = time.monotonic()
    result = _cli(lab, "train", str(recipe), "--cluster", str(cluster), "--strategy", "multi-worker",
                  "--epochs", "50", "--", "--samples", "400")
    wall_s = time.monotonic() - t0
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith(f"error: {lab.hosts['h2'][1]}: ") and "rank 1 failed" in message
    assert "boom on the second host" in message and "fails.py:" in message
    assert "  | about to fail: disk full?" in result.stderr  # the failing rank's last stderr lines
    assert wall_s < 60
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [pid for ns, _ in lab.hosts.values() for pid in _distrun_pids(lab, ns)
                if "distrun.runtime" in " ".join(_cmdline(pid))]
        if not left:
            break
        time.sleep(0.2)
    assert left == []
