"""``distrun export k8s``: the same job as Kubernetes manifests (the seeds' template idea).

The seeds ran multi-worker jobs on Kubernetes with a Jinja template that set TF_CONFIG per
pod. This writes, for a cluster file and a recipe:

- a **ConfigMap** holding the recipe's bundle (the same ``.tar.gz`` ``distrun train``
  ships, so the laptop still ships the code; the image holds none) and the job spec;
- a **headless Service**, so pod ``<job>-<i>`` is ``<job>-<i>.<job>`` in DNS;
- an **Indexed Job**: one pod per worker host entry of the cluster file, its ``slots``
  processes, and its ``gpus`` as ``nvidia.com/gpu``;
- a **Secret** with the job's data-plane secret (never in the ConfigMap: a Secret's reads
  are RBAC's to grant apart), given to each pod as ``DISTRUN_JOB_SECRET``;
- a **NetworkPolicy**: only the job's own pods reach its pods (the store's front, gloo).
  It takes effect where the cluster's network plugin enforces policies.

Each pod runs ``distrun node`` (``cli/node.py``) in a standard image with distrun
installed (its Dockerfile is in docs/kubernetes.md). ``distrun node`` starts the pod's
ranks with torchrun's whole environment and TF_CONFIG, computed from the pod's index
(``JOB_COMPLETION_INDEX``, set by Kubernetes for Indexed Jobs), exactly as a worker
server would. Pod 0 hosts the rendezvous on ``MASTER_PORT``.

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
from distrun.protocol.environment import JOB_SECRET_VAR
from distrun.protocol.secret import new_job_secret

__all__ = ["K8sJob", "manifests", "MASTER_PORT", "MAX_BUNDLE_BYTES"]

MASTER_PORT = 29500
#: A ConfigMap holds at most 1 MiB; base64 grows the bundle by a third.
MAX_BUNDLE_BYTES = 700 * 1024
_MOUNT = "/distrun"


@dataclass(frozen=True)
class K8sJob:
    name: str
    hosts: tuple[HostSpec, ...]  # one pod each, in rank order
    slots: int  # processes per pod
    image: str
    namespace: str | None = None


def job_name(cluster: ClusterSpec, recipe: Path) -> str:
    """A DNS-1123 label from the cluster's and the recipe's names (pod names add ``-<index>``)."""
    raw = f"{cluster.name}-{recipe.stem}".lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")[:50].strip("-")
    return name or "distrun-job"


def manifests(job: K8sJob, spec: JobSpec, bundle: Bundle, secret: str | None = None) -> list[dict[str, Any]]:
    """[Secret, ConfigMap, Service, NetworkPolicy, Job]: the job on Kubernetes (``secret``: the
    data plane's, hex; drawn here when None)."""
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
        "spec": {"clusterIP": "None", "selector": {"job-name": job.name},
                 "ports": [{"name": "rendezvous", "port": MASTER_PORT, "targetPort": MASTER_PORT}]},
    }
    gpus = max((host.gpus or 0) for host in job.hosts)
    resources = {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}
    master = f"{job.name}-0.{job.name}"
    command = ["distrun", "node", "--bundle", f"{_MOUNT}/bundle.tar.gz", "--spec", f"{_MOUNT}/job-spec.json",
               "--recipe", bundle.recipe, "--nnodes", str(nodes), "--nproc-per-node", str(job.slots),
               "--master-addr", master, "--master-port", str(MASTER_PORT),
               "--node-host", f"{job.name}-{{index}}.{job.name}", "--run-id", job.name]
    container = {
        "name": "distrun", "image": job.image, "command": command,
        "env": [
            {"name": "MASTER_ADDR", "value": master},
            {"name": "MASTER_PORT", "value": str(MASTER_PORT)},
            {"name": "WORLD_SIZE", "value": str(nodes * job.slots)},
            {"name": "GROUP_WORLD_SIZE", "value": str(nodes)},
            {"name": "GROUP_RANK", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": "TORCHELASTIC_RUN_ID", "value": job.name},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": JOB_SECRET_VAR, "valueFrom": {"secretKeyRef": {"name": f"{job.name}-secret",
                                                                     "key": "job-secret"}}},
        ],
        "ports": [{"name": "rendezvous", "containerPort": MASTER_PORT}],
        "volumeMounts": [{"name": "bundle", "mountPath": _MOUNT, "readOnly": True}],
        **({"resources": resources} if resources else {}),
    }
    job_manifest = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
        "spec": {
            "completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 0,
            "template": {
                "metadata": {"labels": dict(meta["labels"])},  # a copy: no YAML anchors in the output
                "spec": {"subdomain": job.name, "restartPolicy": "Never", "containers": [container],
                         "volumes": [{"name": "bundle", "configMap": {"name": f"{job.name}-bundle"}}]},
            },
        },
    }
    return [secret_manifest, config_map, service, policy, job_manifest]


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
