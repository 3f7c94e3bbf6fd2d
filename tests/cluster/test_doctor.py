"""`distrun doctor` on two namespace hosts brought up, and a third that cannot be reached."""

from __future__ import annotations

import json
import subprocess
import time

from tests._sshd import cluster_yaml
from tests.cluster.conftest import Lab, brought_up, lab_cli


def test_doctor_rows_for_every_host_and_an_unreachable_one_is_a_row(lab: Lab) -> None:
    roles = {"h1": {"roles": "[chief, worker]"}, "h2": {"roles": "[worker]", "gpus": 1}}
    with brought_up(lab, roles, "doctor") as cluster:
        result = lab_cli(lab, "doctor", str(cluster), "--json")
        assert result.returncode == 0, result.stdout + result.stderr  # a warning (gpus) is not a problem
        rows = {row["host"]: row for row in map(json.loads, result.stdout.splitlines())}
        h1, h2 = lab.hosts["h1"][1], lab.hosts["h2"][1]
        assert list(rows) == [h1, h2]
        for row in rows.values():
            assert row["distrun"] and row["torch"].startswith("2.") and row["python"]
            assert row["reaches_chief"] is True and row["interface"] == "eth0"  # the host's end of its veth
            assert abs(row["skew_s"]) < 1.0 and row["free_bytes"] > 0
        assert rows[h1]["status"] == "ok"
        assert rows[h2]["status"] == "warn" and rows[h2]["warnings"] == ["the cluster file says gpus: 1; torch sees 0"]

        # --links: every pair's rate, as `bench allreduce` measures it (a short job on the cluster).
        result = lab_cli(lab, "doctor", str(cluster), "--links", "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        links = [row for row in map(json.loads, result.stdout.splitlines()) if row["type"] == "link"]
        assert [(link["from"], link["to"]) for link in links] == [(h1, h2)] and links[0]["MBps"] > 1

        # A third host nobody answers at: a row that says so, in bounded time, and exit 6.
        gone = lab.root / "doctor-gone.yaml"
        hosts = [{"address": h1, "roles": "[chief, worker]"}, {"address": h2}, {"address": "10.199.0.250"}]
        gone.write_text(cluster_yaml(lab.keys, hosts, workdir=lab.workdir, name="doctor"))
        t0 = time.monotonic()
        result = lab_cli(lab, "doctor", str(gone))
        assert time.monotonic() - t0 < 40
        assert result.returncode == 6, result.stdout + result.stderr
        assert "10.199.0.250" in result.stdout and "down" in result.stdout
        assert f"{h1}" in result.stdout and "reached" in result.stdout

        # h2 with no route to the chief (sshd still reached from the client): its row says it
        # cannot reach the chief's port, and doctor exits 6 (a job would hang at its rendezvous).
        h2_ns = lab.hosts["h2"][0]
        subprocess.run(["ip", "-n", h2_ns, "route", "add", "unreachable", f"{h1}/32"], check=True)
        try:
            result = lab_cli(lab, "doctor", str(cluster), "--json")
        finally:
            subprocess.run(["ip", "-n", h2_ns, "route", "del", "unreachable", f"{h1}/32"], check=True)
        assert result.returncode == 6, result.stdout + result.stderr
        rows = {row["host"]: row for row in map(json.loads, result.stdout.splitlines())}
        assert rows[h1]["reaches_chief"] is True and rows[h1]["status"] == "ok", rows[h1]
        assert rows[h2]["reaches_chief"] is False and rows[h2]["status"] == "problem", rows[h2]
        assert any(problem.startswith(f"cannot reach the chief {h1}:") for problem in rows[h2]["problems"]), rows[h2]
