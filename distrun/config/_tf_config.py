"""TF_CONFIG as input: a TensorFlow deployment's description of the cluster and this task.

A deployment that already sets TF_CONFIG per task (the seeds' Kubernetes template, any
TensorFlow cluster manager) runs ``distrun node`` with no other wiring. TensorFlow's
meaning is kept:

* ``chief`` (at most one) and ``worker`` entries are the training hosts, the chief first:
  it is node 0, rank 0's host, and its port is the rendezvous. With no chief, worker 0 is
  the chief (TensorFlow's rule for MultiWorkerMirroredStrategy).
* ``ps`` entries are parameter-server tasks, one process each, ranked after every
  training rank (distrun's order: workers, then ps tasks).
* ``evaluator`` entries are the side-car evaluators; they are listed, not ranked.

Entries are ``host:port`` (``[v6]:port`` for IPv6). Only the chief's port is used (the
rendezvous); the others are TensorFlow's per-task server ports, kept descriptive, as the
TF_CONFIG distrun hands its own ranks is.

Every error is one line naming TF_CONFIG and the key at fault, a ``ConfigError`` (exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from distrun.errors import ConfigError

__all__ = ["TF_CONFIG_VAR", "TfConfig", "parse_tf_config"]

TF_CONFIG_VAR = "TF_CONFIG"
_TYPES = ("chief", "worker", "ps", "evaluator")


@dataclass(frozen=True)
class TfConfig:
    """The cluster and this task, as TF_CONFIG said them (addresses without their ports)."""

    training_hosts: tuple[str, ...]  # chief first, then the workers: node i is training_hosts[i]
    ps_hosts: tuple[str, ...]
    evaluator_hosts: tuple[str, ...]
    rendezvous_port: int  # the chief's (or worker 0's) port
    task_type: str  # chief | worker | ps | evaluator
    task_index: int
    has_chief: bool  # a chief entry (else worker 0 is node 0)

    @property
    def nnodes(self) -> int:
        """Training hosts: ``distrun node``'s --nnodes."""
        return len(self.training_hosts)

    @property
    def master_addr(self) -> str:
        return self.training_hosts[0]

    @property
    def node_rank(self) -> int:
        """This task's node among the training hosts (a ps task's: after them, one each)."""
        if self.task_type == "chief":
            return 0
        if self.task_type == "worker":
            return self.task_index + (1 if self.has_chief else 0)
        if self.task_type == "ps":
            return self.nnodes + self.task_index
        return -1  # an evaluator trains on no node


def parse_tf_config(text: str) -> TfConfig:
    """TF_CONFIG's JSON, checked: a malformed one is a ConfigError naming the key at fault."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{TF_CONFIG_VAR}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{TF_CONFIG_VAR}: expected a JSON object with cluster and task. "
                          f"Received: {type(data).__name__}")
    unknown = sorted(set(data) - {"cluster", "task", "environment", "rpc_layer"})
    if unknown:
        raise ConfigError(f"{TF_CONFIG_VAR}: unknown key {unknown[0]!r} (expected cluster, task)")
    cluster, task = data.get("cluster"), data.get("task")
    if not isinstance(cluster, dict):
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster: expected an object of task type -> [\"host:port\", ...]")
    if not isinstance(task, dict):
        raise ConfigError(f"{TF_CONFIG_VAR}: task: expected an object {{\"type\": ..., \"index\": ...}}")
    entries = {kind: _entries(cluster, kind) for kind in _TYPES}
    unknown = sorted(set(cluster) - set(_TYPES))
    if unknown:
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster.{unknown[0]}: not a task type distrun knows "
                          f"(expected {', '.join(_TYPES)})")
    if len(entries["chief"]) > 1:
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster.chief has {len(entries['chief'])} entries; expected at most 1")
    training = entries["chief"] + entries["worker"]
    if not training:
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster: no chief or worker entries (nothing would train)")
    kind, index = task.get("type"), task.get("index", 0)
    if kind not in _TYPES:
        raise ConfigError(f"{TF_CONFIG_VAR}: task.type {kind!r}: expected one of {', '.join(_TYPES)}")
    if isinstance(index, bool) or not isinstance(index, int):
        raise ConfigError(f"{TF_CONFIG_VAR}: task.index {index!r}: expected an integer")
    if not 0 <= index < len(entries[kind]):
        raise ConfigError(f"{TF_CONFIG_VAR}: task.index {index}, but cluster.{kind} has {len(entries[kind])} entries")
    return TfConfig(training_hosts=tuple(host for host, _ in training),
                    ps_hosts=tuple(host for host, _ in entries["ps"]),
                    evaluator_hosts=tuple(host for host, _ in entries["evaluator"]),
                    rendezvous_port=training[0][1], task_type=kind, task_index=index,
                    has_chief=bool(entries["chief"]))


def _entries(cluster: dict, kind: str) -> list[tuple[str, int]]:
    """``cluster[kind]`` as (host, port) pairs."""
    raw = cluster.get(kind, [])
    if not isinstance(raw, list):
        raise ConfigError(f"{TF_CONFIG_VAR}: cluster.{kind}: expected a list of \"host:port\". "
                          f"Received: {type(raw).__name__}")
    return [_address(item, f"cluster.{kind}[{i}]") for i, item in enumerate(raw)]


def _address(item: object, key: str) -> tuple[str, int]:
    host, _, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{TF_CONFIG_VAR}: {key} {item!r}: expected \"host:port\"")
    return host, int(port)
