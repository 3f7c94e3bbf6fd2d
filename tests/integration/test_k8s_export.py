"""`distrun export k8s`: manifests valid against Kubernetes' own schemas, and pods that train.

Offline: `kubernetes-validate` checks every manifest against the Kubernetes OpenAPI
schemas (strict: no unknown fields). Then each pod's own command, read from the Job, is
run here as two processes (node 0 and node 1, as the Indexed Job would start them), with
the ConfigMap's bundle and spec: the job trains over both.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests._sshd import free_port
from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration


def _export(tmp_path: Path, hosts: str) -> dict[str, dict]:
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(f"name: lab\nhosts:\n{hosts}")
    recipe = tmp_path / "job" / "equiv.py"
    recipe.parent.mkdir()
    recipe.write_text(EQUIV)
    out = tmp_path / "k8s"
    result = run_cli("export", "k8s", str(cluster), str(recipe), "-o", str(out), "--steps", "12")
    assert result.returncode == 0, result.stderr
    objects = {}
    for path in sorted(out.glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        objects[obj["kind"]] = obj
    return objects


def test_manifests_are_valid_and_say_the_cluster_files_job(tmp_path):
    objects = _export(tmp_path, "  - {address: 10.0.0.1, roles: [chief, worker], slots: 4, gpus: 4}\n"
                                "  - {address: 10.0.0.2, slots: 4, gpus: 4}\n"
                                "  - {address: 10.0.0.3, roles: [evaluator]}\n")
    assert sorted(objects) == ["ConfigMap", "Job", "NetworkPolicy", "Secret", "Service"]
    job = objects["Job"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == 2  # worker hosts only
    pod = job["template"]["spec"]
    assert pod["subdomain"] == objects["Service"]["metadata"]["name"] == "lab-equiv"
    assert objects["Service"]["spec"]["clusterIP"] == "None"
    container = pod["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 4}}
    assert container["command"][:2] == ["distrun", "node"]
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["WORLD_SIZE"] == "8" and env["MASTER_ADDR"] == "lab-equiv-0.lab-equiv" and env["GROUP_WORLD_SIZE"] == "2"
    spec = json.loads(objects["ConfigMap"]["data"]["job-spec.json"])
    assert spec["strategy"] == {**spec["strategy"], "name": "multi-worker", "replicas": 8, "device": "cuda"}
    # The data plane's secret is a Secret, handed to the pods by reference, never in the ConfigMap.
    secret = objects["Secret"]["stringData"]["job-secret"]
    assert len(secret) == 64 and secret not in yaml.safe_dump(objects["ConfigMap"]) and secret not in str(container)
    by_name = {item["name"]: item for item in container["env"]}
    assert by_name["DISTRUN_JOB_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": objects["Secret"]["metadata"]["name"],
                                                                         "key": "job-secret"}
    # Only the job's own pods reach its pods: the policy selects them, and admits only them.
    policy = objects["NetworkPolicy"]["spec"]
    pod_labels = objects["Job"]["spec"]["template"]["metadata"]["labels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert [peer["podSelector"] for rule in policy["ingress"] for peer in rule["from"]] == [policy["podSelector"]]
    bundle = base64.b64decode(objects["ConfigMap"]["binaryData"]["bundle.tar.gz"])
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
        assert "equiv.py" in tar.getnames()  # the laptop still ships the code: the image holds none


def test_the_pods_command_trains_the_job_over_two_nodes(tmp_path):
    objects = _export(tmp_path, "  - {address: 10.0.0.1, roles: [chief, worker], slots: 1}\n"
                                "  - {address: 10.0.0.2, slots: 1}\n")
    mounted = tmp_path / "mounted"  # what the ConfigMap volume holds in the pod
    mounted.mkdir()
    (mounted / "bundle.tar.gz").write_bytes(base64.b64decode(objects["ConfigMap"]["binaryData"]["bundle.tar.gz"]))
    (mounted / "job-spec.json").write_text(objects["ConfigMap"]["data"]["job-spec.json"])
    command = objects["Job"]["spec"]["template"]["spec"]["containers"][0]["command"]
    port = str(free_port())
    here = {"/distrun/bundle.tar.gz": str(mounted / "bundle.tar.gz"), "/distrun/job-spec.json": str(mounted / "job-spec.json"),
            "lab-equiv-0.lab-equiv": "127.0.0.1", "lab-equiv-{index}.lab-equiv": "127.0.0.1", "29500": port}
    argv = [sys.executable, "-m", "distrun", *[here.get(arg, arg) for arg in command[1:]]]
    secret = objects["Secret"]["stringData"]["job-secret"]  # what the secretKeyRef gives each pod
    pods = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "JOB_COMPLETION_INDEX": str(index), "DISTRUN_JOB_SECRET": secret})
            for index in (0, 1)]
    outs = [pod.communicate(timeout=180) for pod in pods]
    for pod, (out, err) in zip(pods, outs):
        assert pod.returncode == 0, err[-2000:]
    done = [json.loads(line) for out, _ in outs for line in out.splitlines() if '"type": "done"' in line]
    assert sorted(event["rank"] for event in done) == [0, 1]
    assert {event["steps"] for event in done} == {12}
    # Every rank reports the same all-reduced loss, so the pods agreeing proves nothing: the
    # loss must be one-device's over the same 12 global batches.
    alone = run_cli("train", str(tmp_path / "job" / "equiv.py"), "--strategy", "one-device", "--steps", "12", "--json")
    assert alone.returncode == 0, alone.stderr[-2000:]
    for event in done:
        assert event["final_loss"] == pytest.approx(alone.summary["final_loss"], rel=1e-5), (event, alone.summary)
