"""Every way TF_CONFIG can be wrong is one line naming TF_CONFIG and the key at fault (issue 51).

tests/integration/test_tf_config.py runs a few of them through `distrun node` (exit 2, one line on
stderr); the rest are read here, from the parser and the spec's reshaping, so none is unwritten."""

from __future__ import annotations

import json

import pytest

from distrun.cli.node import _spec_for
from distrun.config import JobSpec, StrategyName
from distrun.config._tf_config import parse_tf_config
from distrun.errors import ConfigError

TWO = {"chief": ["a:1"], "worker": ["b:2"]}


def _task(kind: str = "worker", index: object = 0) -> dict:
    return {"type": kind, "index": index}


@pytest.mark.parametrize(("data", "message"), [
    ([1, 2], "TF_CONFIG: expected a JSON object with cluster and task. Received: list"),
    ({"cluster": TWO, "task": _task(), "extra": 1}, "TF_CONFIG: unknown key 'extra' (expected cluster, task)"),
    ({"cluster": ["a:1"], "task": _task()}, 'TF_CONFIG: cluster: expected an object of task type -> ["host:port", ...]'),
    ({"cluster": TWO, "task": "worker"}, 'TF_CONFIG: task: expected an object {"type": ..., "index": ...}'),
    ({"cluster": {"chief": ["a:1", "c:3"]}, "task": _task("chief")},
     "TF_CONFIG: cluster.chief has 2 entries; expected at most 1"),
    ({"cluster": {"ps": ["p:1"]}, "task": _task("ps")},
     "TF_CONFIG: cluster: no chief or worker entries (nothing would train)"),
    ({"cluster": TWO, "task": _task("master")}, "TF_CONFIG: task.type 'master': expected one of chief, worker, ps, evaluator"),
    ({"cluster": TWO, "task": _task("worker", "0")}, "TF_CONFIG: task.index '0': expected an integer"),
    ({"cluster": TWO, "task": _task("worker", True)}, "TF_CONFIG: task.index True: expected an integer"),
    ({"cluster": {"worker": "b:2"}, "task": _task()}, 'TF_CONFIG: cluster.worker: expected a list of "host:port". Received: str'),
    ({"cluster": {"worker": ["b:99999"]}, "task": _task()}, "TF_CONFIG: cluster.worker[0] 'b:99999': expected \"host:port\""),
], ids=["not-an-object", "unknown-key", "cluster-not-an-object", "task-not-an-object", "two-chiefs", "no-trainers",
        "unknown-task-type", "index-a-string", "index-a-bool", "entries-not-a-list", "port-out-of-range"])
def test_a_malformed_tf_config_names_the_key(data, message):
    with pytest.raises(ConfigError) as raised:
        parse_tf_config(json.dumps(data))
    assert str(raised.value) == message


def _spec(strategy: StrategyName, **flat: object) -> JobSpec:
    return JobSpec.of("/r.py", strategy=strategy, **flat)


@pytest.mark.parametrize(("spec", "cluster", "trainers", "message"), [
    (_spec(StrategyName.MULTI_WORKER), {**TWO, "ps": ["p:1"]}, 2,
     "TF_CONFIG: cluster.ps has 1 entries, but the job's strategy is multi-worker (ps tasks run under "
     "parameter-server and --embeddings ps)"),
    (_spec(StrategyName.PARAMETER_SERVER, ps_tasks=1), TWO, 2,
     "TF_CONFIG: cluster.ps: parameter-server needs at least one ps entry"),
    (_spec(StrategyName.MULTI_WORKER, tp=2), {"chief": ["a:1"], "worker": ["b:2", "c:3"]}, 3,
     "TF_CONFIG: cluster has 3 training ranks (chief and workers x --nproc-per-node); the job's replicas are "
     "2 ranks each (--tp x --pp)"),
], ids=["ps-entries-without-ps", "parameter-server-without-ps", "ranks-not-a-multiple-of-tp"])
def test_a_tf_config_at_odds_with_the_job_says_so(spec, cluster, trainers, message):
    tf = parse_tf_config(json.dumps({"cluster": cluster, "task": _task("chief")}))
    with pytest.raises(ConfigError) as raised:
        _spec_for(spec, tf, trainers)
    assert str(raised.value) == message
