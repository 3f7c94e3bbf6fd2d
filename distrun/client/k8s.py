"""``distrun export k8s``: the same job as Kubernetes manifests (the seeds' template idea).

The seeds ran multi-worker jobs on Kubernetes with a Jinja template that set TF_CONFIG per
pod. This writes, for a cluster file and a recipe:

- a **ConfigMap** holding the recipe's bundle (the same ``.tar.gz`` ``distrun train``
  ships, so the laptop still ships the code; the image holds none) and the job spec;
- a **headless Service**, so pod ``<job>-<i>`` is ``<job>-<i>.<job>`` in DNS;
- an **Indexed Job**: one pod per worker host entry of the cluster file, its ``slots``
  processes, and ``nvidia.com/gpu`` limits of the GPUs each pod asks for (``gpus: auto``
  cannot be exported: a pod's GPUs are asked for before it is placed, so the export needs
  ``--gpus-per-pod N``, 0 for CPU pods; a CPU job is never written silently);
- under parameter-server, a second Indexed Job ``<job>-ps``: one CPU pod per ps host;
- a **Secret** with the job's data-plane secret (never in the ConfigMap: a Secret's reads
  are RBAC's to grant apart), given to each pod as ``DISTRUN_JOB_SECRET``;
- a **NetworkPolicy**: only the job's own pods reach its pods (the store's front, gloo).
  It takes effect where the cluster's network plugin enforces policies.

Each pod runs ``distrun node`` (``cli/node.py``) in a standard image with distrun
installed (its Dockerfile is in docs/kubernetes.md). ``distrun node`` starts the pod's
ranks with torchrun's whole environment and TF_CONFIG, computed from the pod's index
(``JOB_COMPLETION_INDEX``, set by Kubernetes for Indexed Jobs), exactly as a worker
server would. Pod 0 hosts the rendezvous on ``MASTER_PORT``. Under parameter-server every pod
is placed by TF_CONFIG instead (``config/_tf_config``): the cluster's worker and ps pods by
DNS name, its own task's index from the completion index (``$(GROUP_RANK)``, Kubernetes'
dependent environment variables), so the ps pods are ps tasks with no flags of their own.

Recovery: a pod lost to its node (eviction, preemption, drain: the ``DisruptionTarget``
condition) is replaced without counting against ``backoffLimit`` (``podFailurePolicy``);
a failed one counts, and ``backoffLimit`` is ``restarts`` x the pods, as one restart of a
synchronous job fails every pod. Exit codes that no restart mends (2 usage, 3 recipe,
5 checkpoint) fail the Job at once. A pod told to end (the kubelet's SIGTERM at a drain or
a preemption) has every rank checkpoint at one agreed step and stop, exit 75, not counted
either (``--checkpoint-on-sigterm``, a fit-style recipe under a synchronous strategy).
With a checkpoint folder, every pod runs with ``--resume-if-any``: a replaced pod, and the
ones it takes down, resume from the newest checkpoint, as the Slurm export's ``--requeue``
does. The folder is a volume at the same
path in every pod: a PersistentVolumeClaim, or an ``emptyDir`` (lost with its pod: the
export warns).

The output is plain data (dicts) and YAML; nothing here talks to a cluster.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distrun.client._bundle import Bundle
from distrun.config import ClusterSpec, HostSpec, JobSpec
from distrun.errors import UsageError
from distrun.protocol.environment import JOB_SECRET_VAR, PREEMPTED_EXIT_CODE
from distrun.protocol.secret import new_job_secret

__all__ = ["K8sJob", "manifests", "pod_gpus", "MASTER_PORT", "MAX_BUNDLE_BYTES"]

MASTER_PORT = 29500
#: A ConfigMap holds at most 1 MiB; base64 grows the bundle by a third.
MAX_BUNDLE_BYTES = 700 * 1024
_MOUNT = "/distrun"


#: Exit codes a restart cannot mend (docs/cli.md): usage or config, the recipe, a checkpoint.
_FATAL_EXIT_CODES = [2, 3, 5]


@dataclass(frozen=True)
class K8sJob:
    name: str
    hosts: tuple[HostSpec, ...]  # one pod each, in rank order
    slots: int  # processes per pod
    image: str
    namespace: str | None = None
    gpus: int = 0  # nvidia.com/gpu per training pod
    ps_tasks: int = 0  # parameter-server: ps pods, one ps task each
    checkpoint_dir: str | None = None  # the path in every pod where the checkpoint volume mounts
    checkpoint_pvc: str | None = None  # that volume's claim; None: an emptyDir
    restarts: int = 3  # times the whole job may fail and resume
    checkpoint_on_sigterm: bool = False  # a preemptible spec: SIGTERM checkpoints at one step, exit 75
    grace_s: int = 60  # terminationGracePeriodSeconds: SIGTERM to SIGKILL


def pod_gpus(hosts: tuple[HostSpec, ...], gpus_per_pod: int | None, source: str) -> int:
    """GPUs each training pod asks for: ``--gpus-per-pod``, else the hosts' own count. ``auto``
    is refused: Kubernetes places a pod by what it asks for, so a pod cannot detect its GPUs first."""
    if gpus_per_pod is not None:
        if gpus_per_pod < 0:
            raise UsageError(f"--gpus-per-pod: expected 0 (CPU pods) or more. Received: {gpus_per_pod}")
        return gpus_per_pod
    auto = [host for host in hosts if host.gpus is None]
    if auto:
        raise UsageError(f"export k8s: {source}: host {auto[0].address} has gpus: auto, which a pod cannot detect "
                         "before Kubernetes places it; give --gpus-per-pod N (0: CPU pods)")
    counts = sorted({host.gpus or 0 for host in hosts})
    if len(counts) != 1:
        raise UsageError(f"export k8s: {source}: every worker host needs the same gpus (one pod template); they "
                         f"have {', '.join(map(str, counts))} (or give --gpus-per-pod N)")
    return counts[0]


def job_name(cluster: ClusterSpec, recipe: Path) -> str:
    """A DNS-1123 label from the cluster's and the recipe's names (pod names add ``-<index>``)."""
    raw = f"{cluster.name}-{recipe.stem}".lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")[:50].strip("-")
    return name or "distrun-job"


def manifests(job: K8sJob, spec: JobSpec, bundle: Bundle, secret: str | None = None) -> list[dict[str, Any]]:
    """[Secret, ConfigMap, Service, NetworkPolicy, Job, and the ps Job under parameter-server]: the
    job on Kubernetes (``secret``: the data plane's, hex; drawn here when None)."""
    if bundle.size_bytes > MAX_BUNDLE_BYTES:
        raise UsageError(f"export k8s: the recipe's bundle is {bundle.size_bytes / 1024:.0f} KiB; a ConfigMap holds "
                         f"{MAX_BUNDLE_BYTES // 1024} KiB of it (1 MiB after base64). Leave data out of the recipe's "
                         "folder (.distrunignore) and read it from a volume")
    nodes = len(job.hosts)
    meta = {"name": job.name, **({"namespace": job.namespace} if job.namespace else {}),
            "labels": {"app.kubernetes.io/name": "distrun", "app.kubernetes.io/instance": job.name}}
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{job.name}-bundle", "labels": dict(meta["labels"])},
        "data": {"job-spec.json": spec.to_json(), "recipe": bundle.recipe},
        "binaryData": {"bundle.tar.gz": base64.b64encode(bundle.data).decode()},
    }
    secret_manifest = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {**meta, "name": f"{job.name}-secret", "labels": dict(meta["labels"])},
        "stringData": {"job-secret": secret or new_job_secret()},
    }
    own_pods = {"matchLabels": {"app.kubernetes.io/instance": job.name}}
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {**meta, "labels": dict(meta["labels"])},
        "spec": {"podSelector": dict(own_pods), "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": dict(own_pods["matchLabels"])}}]}]},
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": {**meta, "labels": dict(meta["labels"])},
        "spec": {"clusterIP": "None", "selector": dict(own_pods["matchLabels"]),  # worker and ps pods alike
                 "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT}]},
    }
    master = f"{job.name}-0.{job.name}"
    common = ["distrun", "node", "--bundle", f"{_MOUNT}/bundle.tar.gz", "--spec", f"{_MOUNT}/job-spec.json",
              "--recipe", bundle.recipe]
    after = ["--run-id", job.name] + (["--checkpoint-dir", job.checkpoint_dir, "--resume-if-any"]
                                      if job.checkpoint_dir else [])
    after += ["--checkpoint-on-sigterm"] if job.checkpoint_on_sigterm else []
    index = {"name": "GROUP_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}
    if job.ps_tasks:  # every pod placed by TF_CONFIG: the ps pods are ps tasks (cli/node.py)
        command = [*common, "--nproc-per-node", str(job.slots), *after]
        placement = [index, _tf_config(job, "worker")]
    else:
        command = [*common, "--nnodes", str(nodes), "--nproc-per-node", str(job.slots),
                   "--master-addr", master, "--master-port", str(MASTER_PORT),
                   "--node-host", f"{job.name}-{{index}}.{job.name}", *after]
        placement = [index]
    env = [
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
        {"name": "WORLD_SIZE", "value": str(nodes * job.slots + job.ps_tasks)},
        {"name": "GROUP_WORLD_SIZE", "value": str(nodes)},
        *placement,
        {"name": "TORCHELASTIC_RUN_ID", "value": job.name},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": JOB_SECRET_VAR, "valueFrom": {"secretKeyRef": {"name": f"{job.name}-secret", "key": "job-secret"}}},
    ]
    resources = {"limits": {"nvidia.com/gpu": job.gpus}} if job.gpus else {}
    objects = [secret_manifest, config_map, service, policy,
               _indexed_job(job, meta, job.name, nodes, command, env, resources)]
    if job.ps_tasks:
        ps_env = [item for item in env if item["name"] not in ("GROUP_WORLD_SIZE", "TF_CONFIG")]
        ps_env.insert(ps_env.index(index) + 1, _tf_config(job, "ps"))
        objects.append(_indexed_job(job, meta, f"{job.name}-ps", job.ps_tasks,
                                    [*common, "--nproc-per-node", "1", *after], ps_env, {}))
    return objects


def _tf_config(job: K8sJob, task_type: str) -> dict[str, str]:
    """TF_CONFIG of a pod: every pod by DNS name, its own index Kubernetes' completion index, put in
    by ``$(GROUP_RANK)`` (an earlier variable of the same container, expanded by the kubelet)."""
    cluster = {"worker": [f"{job.name}-{i}.{job.name}:{MASTER_PORT}" for i in range(len(job.hosts))],
               "ps": [f"{job.name}-ps-{i}.{job.name}:{MASTER_PORT}" for i in range(job.ps_tasks)]}
    value = '{"cluster": %s, "task": {"type": "%s", "index": $(GROUP_RANK)}}' % (json.dumps(cluster), task_type)
    return {"name": "TF_CONFIG", "value": value}


def _indexed_job(job: K8sJob, meta: dict[str, Any], name: str, pods: int, command: list[str],
                 env: list[dict[str, Any]], resources: dict[str, Any]) -> dict[str, Any]:
    """An Indexed Job of ``pods`` pods that restarts as the module's docstring says."""
    mounts = [{"name": "bundle", "mountPath": _MOUNT, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "bundle", "configMap": {"name": f"{job.name}-bundle"}}]
    if job.checkpoint_dir:
        mounts.append({"name": "checkpoints", "mountPath": job.checkpoint_dir})
        volumes.append({"name": "checkpoints", **({"persistentVolumeClaim": {"claimName": job.checkpoint_pvc}}
                                                  if job.checkpoint_pvc else {"emptyDir": {}})})
    container = {
        "name": "distrun", "image": job.image, "command": command, "env": env,
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT}], "volumeMounts": mounts,
        **({"resources": resources} if resources else {}),
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {**meta, "name": name, "labels": dict(meta["labels"])},
        "spec": {
            "completionMode": "Indexed", "completions": pods, "parallelism": pods,
            "backoffLimit": job.restarts * pods,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "distrun", "operator": "In",
                                                      "values": list(_FATAL_EXIT_CODES)}},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                # Told to end (SIGTERM): every rank checkpointed at one step; the replacement resumes there.
                *([{"action": "Ignore", "onExitCodes": {"containerName": "distrun", "operator": "In",
                                                        "values": [PREEMPTED_EXIT_CODE]}}]
                  if job.checkpoint_on_sigterm else []),
            ]},
            "template": {
                "metadata": {"labels": dict(meta["labels"])},  # a copy: no YAML anchors in the output
                "spec": {"subdomain": job.name, "restartPolicy": "Never", "containers": [container],
                         "volumes": volumes,
                         **({"terminationGracePeriodSeconds": job.grace_s} if job.checkpoint_on_sigterm else {})},
            },
        },
    }


def write(objects: list[dict[str, Any]], out: Path) -> list[Path]:
    """One YAML file per object in ``out`` (``kubectl apply -f out/``)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, obj in enumerate(objects):
        path = out / f"{index:02d}-{obj['kind'].lower()}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False, width=120))
        paths.append(path)
    return paths


def describe(objects: list[dict[str, Any]]) -> str:
    return json.dumps([{"kind": obj["kind"], "name": obj["metadata"]["name"]} for obj in objects])
