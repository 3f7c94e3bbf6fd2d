"""`distrun export k8s`: manifests valid against Kubernetes' own schemas, and pods that train.

Offline: `kubernetes-validate` checks every manifest against the Kubernetes OpenAPI
schemas (strict: no unknown fields). Then each pod of each Job is run here as a local
process: the container's own command and its own environment as the kubelet would give it
(the completion index, the Secret's value, `$(VAR)` references expanded), with the
ConfigMap's bundle and spec at the mounted paths and the pods' DNS names on loopback. The
pods train to one-device's parameters; a pod killed with its ranks (a lost node) and the
Job's replacements resume from the newest checkpoint and still do; under parameter-server
the ps pods, placed by TF_CONFIG alone, serve the workers.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from distrun.strategies import latest_checkpoint
from tests._sshd import free_port
from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration

TWO_CPU_HOSTS = "  - {address: 10.0.0.1, roles: [chief, worker], slots: 1}\n  - {address: 10.0.0.2, slots: 1}\n"
# EQUIV, each step slowed by $SLOW_STEP_S (the same numbers: a pod can be lost mid-job).
SLOW_EQUIV = EQUIV + """
import os
import time

_loss = loss


def loss(outputs, batch):
    time.sleep(float(os.environ.get("SLOW_STEP_S", "0")))
    return _loss(outputs, batch)
"""


def _export(tmp_path: Path, hosts: str, *flags: str, source: str = EQUIV, validate: bool = True) -> list[dict]:
    """The manifests, each validated strictly (``validate=False``: tests/gpu, where the schemas are not installed)."""
    cluster = tmp_path / "lab.yaml"
    recipe = tmp_path / "job" / "equiv.py"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    cluster.write_text(f"name: lab\nhosts:\n{hosts}")
    recipe.write_text(source)
    out = tmp_path / "k8s"
    result = run_cli("export", "k8s", str(cluster), str(recipe), "-o", str(out), "--steps", "12", *flags)
    assert result.returncode == 0, result.stderr
    objects = []
    for path in sorted(out.glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        if validate:
            import kubernetes_validate

            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)
        objects.append(obj)
    return objects


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {obj["kind"]: obj for obj in objects}


def _container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def test_manifests_are_valid_and_say_the_cluster_files_job(tmp_path):
    objects = _by_kind(_export(tmp_path, "  - {address: 10.0.0.1, roles: [chief, worker], slots: 4, gpus: 4}\n"
                                         "  - {address: 10.0.0.2, slots: 4, gpus: 4}\n"
                                         "  - {address: 10.0.0.3, roles: [evaluator]}\n"))
    assert sorted(objects) == ["ConfigMap", "Job", "NetworkPolicy", "Secret", "Service"]
    job = objects["Job"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == 2  # worker hosts only
    # Restarts: 3 of the whole job (each fails both pods); a pod lost to its node is not counted;
    # exit codes no restart mends fail the Job at once.
    assert job["backoffLimit"] == 6
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    assert {"action": "FailJob", "onExitCodes": {"containerName": "distrun", "operator": "In",
                                                 "values": [2, 3, 5]}} in rules
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
    assert objects["Service"]["spec"]["selector"].items() <= pod_labels.items()
    assert [peer["podSelector"] for rule in policy["ingress"] for peer in rule["from"]] == [policy["podSelector"]]
    bundle = base64.b64decode(objects["ConfigMap"]["binaryData"]["bundle.tar.gz"])
    with tarfile.open(fileobj=io.BytesIO(bundle)) as tar:
        assert "equiv.py" in tar.getnames()  # the laptop still ships the code: the image holds none


def test_the_help_names_every_object_the_export_writes(tmp_path):
    """Issue 51: the help named three objects where the export wrote five."""
    kinds = {obj["kind"] for obj in _export(tmp_path, "  - {address: 10.0.0.1, roles: [chief, worker], gpus: 0}\n")}
    assert kinds == {"ConfigMap", "Job", "NetworkPolicy", "Secret", "Service"}, kinds
    shown = run_cli("export", "k8s", "--help", env={"COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    said = text[text.index("Write Kubernetes manifests"):text.index("Arguments")]
    assert all(kind in said for kind in kinds) and "ps pods" in said, said


def test_gpus_auto_needs_gpus_per_pod_and_never_becomes_a_cpu_job(tmp_path):
    cluster = tmp_path / "lab.yaml"
    cluster.write_text("name: lab\nhosts:\n  - {address: 10.0.0.1, roles: [chief, worker], gpus: auto}\n"
                       "  - {address: 10.0.0.2}\n")
    recipe = tmp_path / "equiv.py"
    recipe.write_text(EQUIV)
    refused = run_cli("export", "k8s", str(cluster), str(recipe), "-o", str(tmp_path / "no"))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: export k8s: {cluster}: host 10.0.0.1 has gpus: auto, which a pod cannot detect before "
        "Kubernetes places it; give --gpus-per-pod N (0: CPU pods)"]
    assert not (tmp_path / "no").exists()
    objects = _by_kind(_export(tmp_path, "  - {address: 10.0.0.1, roles: [chief, worker]}\n  - {address: 10.0.0.2}\n",
                               "--gpus-per-pod", "2"))
    container = _container(objects["Job"])
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert container["command"][container["command"].index("--nproc-per-node") + 1] == "2"  # a rank per GPU
    spec = json.loads(objects["ConfigMap"]["data"]["job-spec.json"])
    assert spec["strategy"] == {**spec["strategy"], "replicas": 4, "device": "cuda"}


def test_the_checkpoint_folder_is_a_claim_or_an_empty_dir_with_a_warning(tmp_path):
    claim = _by_kind(_export(tmp_path / "a", TWO_CPU_HOSTS, "--gpus-per-pod", "0", "--checkpoint-dir", "/ckpt",
                             "--checkpoint-pvc", "lab-checkpoints"))
    pod = claim["Job"]["spec"]["template"]["spec"]
    assert {"name": "checkpoints", "mountPath": "/ckpt"} in pod["containers"][0]["volumeMounts"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "lab-checkpoints"}} in pod["volumes"]
    assert pod["containers"][0]["command"][-4:] == ["--checkpoint-dir", "/ckpt", "--resume-if-any",
                                                    "--checkpoint-on-sigterm"]
    assert json.loads(claim["ConfigMap"]["data"]["job-spec.json"])["checkpoint"]["dir"] == "/ckpt"
    (tmp_path / "b").mkdir()
    cluster = tmp_path / "a" / "lab.yaml"
    result = run_cli("export", "k8s", str(cluster), str(tmp_path / "a" / "job" / "equiv.py"), "-o",
                     str(tmp_path / "b" / "k8s"), "--gpus-per-pod", "0", "--checkpoint-dir", "/ckpt")
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: --checkpoint-dir /ckpt is an emptyDir: its checkpoints are lost with their pod, so a pod "
        "replaced after a node failure starts from step 0; give --checkpoint-pvc NAME to resume"]
    job = yaml.safe_load(next((tmp_path / "b" / "k8s").glob("*-job.yaml")).read_text())
    assert {"name": "checkpoints", "emptyDir": {}} in job["spec"]["template"]["spec"]["volumes"]
    for flags, message in ((("--checkpoint-pvc", "x"), "error: --checkpoint-pvc: mounted at --checkpoint-dir, which is not given"),
                           (("--checkpoint-dir", "ckpt"), "error: --checkpoint-dir: a path in the pods, where the volume mounts")):
        bad = run_cli("export", "k8s", str(cluster), str(tmp_path / "a" / "job" / "equiv.py"), "-o",
                      str(tmp_path / "c"), "--gpus-per-pod", "0", *flags)
        assert bad.returncode == 2 and bad.stderr.strip().startswith(message), bad.stderr


class Pods:
    """The Jobs' pods as local processes, each as the kubelet would start it."""

    def __init__(self, objects: list[dict], tmp_path: Path, ckpt: Path) -> None:
        kinds = _by_kind(objects)
        self.jobs = [obj for obj in objects if obj["kind"] == "Job"]
        self.name = kinds["Service"]["metadata"]["name"]
        self.secret = kinds["Secret"]["stringData"]["job-secret"]
        mounted = tmp_path / "mounted"  # what the ConfigMap volume holds in the pod
        mounted.mkdir(exist_ok=True)
        (mounted / "bundle.tar.gz").write_bytes(base64.b64decode(kinds["ConfigMap"]["binaryData"]["bundle.tar.gz"]))
        (mounted / "job-spec.json").write_text(kinds["ConfigMap"]["data"]["job-spec.json"])
        self.paths = {"/distrun/bundle.tar.gz": str(mounted / "bundle.tar.gz"),
                      "/distrun/job-spec.json": str(mounted / "job-spec.json"), "/ckpt": str(ckpt)}
        self.port = str(free_port())

    def _here(self, text: str) -> str:
        """A pod's string on this machine: every pod's DNS name on loopback, the rendezvous port free."""
        text = self.paths.get(text, text)
        text = re.sub(rf"{re.escape(self.name)}-(ps-)?(\d+|{{index}})\.{re.escape(self.name)}", "127.0.0.1", text)
        return self.port if text == "29500" else text.replace(":29500", f":{self.port}")

    def _env(self, container: dict, index: int, extra: dict[str, str]) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in ("TF_CONFIG", "JOB_COMPLETION_INDEX")}
        env.update(extra, JOB_COMPLETION_INDEX=str(index))  # Kubernetes sets it for Indexed Jobs
        for item in container["env"]:
            if "value" in item:  # $(VAR): an earlier variable of the container, as the kubelet expands it
                value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"])
            elif "fieldRef" in item["valueFrom"]:
                assert "job-completion-index" in item["valueFrom"]["fieldRef"]["fieldPath"]
                value = str(index)
            else:
                assert item["valueFrom"]["secretKeyRef"]["key"] == "job-secret"
                value = self.secret
            env[item["name"]] = self._here(value)
        return env

    def start(self, **extra: str) -> list[subprocess.Popen]:
        procs = []
        for job in self.jobs:
            container = _container(job)
            argv = [sys.executable, "-m", "distrun", *[self._here(arg) for arg in container["command"][1:]]]
            for index in range(job["spec"]["completions"]):
                procs.append(subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True, env=self._env(container, index, extra)))
        return procs


def _finish(procs: list[subprocess.Popen]) -> list[dict]:
    outs = [proc.communicate(timeout=240) for proc in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-2000:]
    return [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]


def _one_device(tmp_path: Path, *flags: str) -> dict[str, torch.Tensor]:
    ckpt = tmp_path / "one-device"
    alone = run_cli("train", str(tmp_path / "job" / "equiv.py"), "--strategy", "one-device", "--steps", "12",
                    "--json", "--checkpoint-dir", str(ckpt), *flags)
    assert alone.returncode == 0, alone.stderr[-2000:]
    return torch.load(latest_checkpoint(ckpt), weights_only=True)["model"]


def _assert_one_devices(ckpt: Path, alone: dict[str, torch.Tensor], strategy: str) -> None:
    data = torch.load(latest_checkpoint(ckpt), weights_only=True)
    assert data["step"] == 12 and data["strategy"] == strategy
    for key, tensor in alone.items():
        torch.testing.assert_close(data["model"][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def _kill_with_its_ranks(proc: subprocess.Popen) -> None:
    """The pod's node is lost: the pod and every process it started, at once."""
    tree = psutil.Process(proc.pid)
    for member in [tree, *tree.children(recursive=True)]:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    proc.communicate(timeout=30)


def test_the_pods_train_to_one_device_and_resume_after_a_lost_pod(tmp_path):
    objects = _export(tmp_path, TWO_CPU_HOSTS, "--gpus-per-pod", "0", "--checkpoint-dir", "/ckpt",
                      "--checkpoint-pvc", "lab-checkpoints", "--checkpoint-every", "4", source=SLOW_EQUIV)
    assert "resources" not in _container(_by_kind(objects)["Job"])  # CPU pods, as asked for
    ckpt = tmp_path / "ckpt"  # what the claim holds
    pods = Pods(objects, tmp_path, ckpt)
    first = pods.start(SLOW_STEP_S="0.3")
    deadline = time.monotonic() + 120
    while latest_checkpoint(ckpt) is None:  # the first checkpoint (step 4) is written
        assert time.monotonic() < deadline and all(proc.poll() is None for proc in first), "no checkpoint"
        time.sleep(0.1)
    _kill_with_its_ranks(first[1])  # pod 1's node is lost mid-job
    first[0].communicate(timeout=120)
    assert first[0].returncode == 4  # pod 0 fails with it (its peer is gone): counted, replaced
    step_then = torch.load(latest_checkpoint(ckpt), weights_only=True)["step"]
    assert 4 <= step_then < 12
    events = _finish(pods.start())  # the Job's replacement pods: the same command and environment
    resumed = [event for event in events if event.get("type") == "resumed"]
    assert resumed and {event["step"] for event in resumed} >= {step_then}, resumed
    done = [event for event in events if event.get("type") == "done"]
    assert sorted(event["rank"] for event in done) == [0, 1] and {event["steps"] for event in done} == {12}
    # The resumed job ends with one-device's parameters over the same 12 global batches.
    _assert_one_devices(ckpt, _one_device(tmp_path), "multi-worker")


def test_a_drained_pod_checkpoints_at_sigterm_and_the_job_resumes_there(tmp_path):
    objects = _export(tmp_path, TWO_CPU_HOSTS, "--gpus-per-pod", "0", "--checkpoint-dir", "/ckpt",
                      "--checkpoint-pvc", "lab-checkpoints", "--checkpoint-every", "4", "--grace-s", "90",
                      source=SLOW_EQUIV)
    job = _by_kind(objects)["Job"]["spec"]
    assert job["template"]["spec"]["terminationGracePeriodSeconds"] == 90
    assert "--checkpoint-on-sigterm" in _container(_by_kind(objects)["Job"])["command"]
    assert {"action": "Ignore", "onExitCodes": {"containerName": "distrun", "operator": "In", "values": [75]}} \
        in job["podFailurePolicy"]["rules"]  # told to end and checkpointed: not a failure
    ckpt = tmp_path / "ckpt"
    pods = Pods(objects, tmp_path, ckpt)
    first = pods.start(SLOW_STEP_S="0.3")
    deadline = time.monotonic() + 120
    while latest_checkpoint(ckpt) is None:
        assert time.monotonic() < deadline and all(proc.poll() is None for proc in first), "no checkpoint"
        time.sleep(0.1)
    for proc in first:  # a drain: the kubelet sends each pod's container SIGTERM
        proc.send_signal(signal.SIGTERM)
    for proc in first:
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 75, err[-2000:]
    step_then = torch.load(latest_checkpoint(ckpt), weights_only=True)["step"]
    assert 4 < step_then < 12  # the step they agreed on, past the last periodic checkpoint
    events = _finish(pods.start())
    assert {event["step"] for event in events if event.get("type") == "resumed"} == {step_then}
    _assert_one_devices(ckpt, _one_device(tmp_path), "multi-worker")


def test_parameter_server_exports_ps_pods_placed_by_tf_config_and_trains(tmp_path):
    objects = _export(tmp_path, TWO_CPU_HOSTS + "  - {address: 10.0.0.3, roles: [ps]}\n", "-s", "parameter-server",
                      "--ps-sync", "--gpus-per-pod", "0", "--checkpoint-dir", "/ckpt", "--checkpoint-pvc", "c")
    jobs = {job["metadata"]["name"]: job for job in objects if job["kind"] == "Job"}
    assert sorted(jobs) == ["lab-equiv", "lab-equiv-ps"] and jobs["lab-equiv-ps"]["spec"]["completions"] == 1
    for name, kind in (("lab-equiv", "worker"), ("lab-equiv-ps", "ps")):
        container = _container(jobs[name])
        assert "--nnodes" not in container["command"] and "--master-addr" not in container["command"]
        tf_config = {item["name"]: item for item in container["env"]}["TF_CONFIG"]["value"]
        assert json.loads(tf_config.replace("$(GROUP_RANK)", "0")) == {
            "cluster": {"worker": ["lab-equiv-0.lab-equiv:29500", "lab-equiv-1.lab-equiv:29500"],
                        "ps": ["lab-equiv-ps-0.lab-equiv:29500"]}, "task": {"type": kind, "index": 0}}
    assert "resources" not in _container(jobs["lab-equiv-ps"])  # a ps task holds parameters on its CPU
    ckpt = tmp_path / "ckpt"
    events = _finish(Pods(objects, tmp_path, ckpt).start())
    assert max(event["updates"] for event in events if event.get("type") == "ps") == 12
    assert sorted(event["rank"] for event in events if event.get("type") == "done") == [0, 1, 2]
    _assert_one_devices(ckpt, _one_device(tmp_path), "parameter-server")


def test_the_hybrid_exports_a_ps_pod_for_its_tables_and_trains_to_one_device(tmp_path):
    """--embeddings ps: the worker pods are the dense replicas, the ps pod holds the large table
    (TF_CONFIG places it); the pods, run as local processes, end with one-device's parameters."""
    recipe = (REPO / "recipes" / "recommender.py").read_text()
    objects = _export(tmp_path, TWO_CPU_HOSTS + "  - {address: 10.0.0.3, roles: [ps]}\n", "--embeddings", "ps",
                      "--ps-partition-mb", "1", "--gpus-per-pod", "0", "--checkpoint-dir", "/ckpt",
                      "--checkpoint-pvc", "c", source=recipe)
    jobs = {job["metadata"]["name"]: job for job in objects if job["kind"] == "Job"}
    assert sorted(jobs) == ["lab-equiv", "lab-equiv-ps"] and jobs["lab-equiv-ps"]["spec"]["completions"] == 1
    ckpt = tmp_path / "ckpt"
    events = _finish(Pods(objects, tmp_path, ckpt).start())
    placement = [event["line"] for event in events if event.get("type") == "output" and "[placement]" in event["line"]]
    assert any("ps0:" in line and "users.weight" in line for line in placement), placement
    assert max(event["updates"] for event in events if event.get("type") == "ps") == 12  # one update a step
    alone = run_cli("train", str(tmp_path / "job" / "equiv.py"), "--strategy", "one-device", "--steps", "12",
                    "--json", "--checkpoint-dir", str(tmp_path / "one-device"))
    assert alone.returncode == 0, alone.stderr[-2000:]
    _assert_one_devices(ckpt, torch.load(latest_checkpoint(tmp_path / "one-device"), weights_only=True)["model"],
                        "multi-worker")
