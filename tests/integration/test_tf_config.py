"""TF_CONFIG as input to `distrun node`: each task's TF_CONFIG, and nothing else, places it.

Three local processes, as a TensorFlow cluster manager would start them, each with its own
TF_CONFIG and the same bundle, job spec and `--nproc-per-node`: the chief is node 0 and
hosts the rendezvous on its TF_CONFIG port, the workers follow, and a ps task (under
parameter-server) is a ps rank. The jobs train to one-device's parameters. A malformed
TF_CONFIG, or one beside the flags it replaces, is one line naming TF_CONFIG, exit 2.
"""

from __future__ import annotations

import json
import os
import runpy
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distrun.cli._spec import build_spec
from distrun.client import pack
from distrun.strategies import latest_checkpoint
from tests._sshd import free_port
from tests.conftest import REPO, run_cli
from tests.integration._recipes import EQUIV

pytestmark = pytest.mark.integration


def _job(tmp_path: Path, strategy: str, replicas: int, batch: int, **options) -> tuple[Path, Path, str]:
    """The bundle and job spec the nodes are given, as an export would write them."""
    recipe = tmp_path / "job" / "equiv.py"
    recipe.parent.mkdir(exist_ok=True)
    recipe.write_text(EQUIV)
    spec = build_spec(recipe=recipe, device="cpu", strategy=strategy, replicas=replicas, steps=12, epochs=None,
                      global_batch_size=batch, seed=None, checkpoint_dir=None, checkpoint_every=None, **options)
    bundle = pack(recipe)
    (tmp_path / "bundle.tar.gz").write_bytes(bundle.data)
    (tmp_path / "job-spec.json").write_text(spec.to_json())
    return tmp_path / "bundle.tar.gz", tmp_path / "job-spec.json", bundle.recipe


def _node_argv(bundle: Path, spec: Path, recipe: str, ckpt: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "distrun", "node", "--bundle", str(bundle), "--spec", str(spec),
            "--recipe", recipe, "--checkpoint-dir", str(ckpt), *extra]


def _run_tasks(argv: list[str], cluster: dict[str, list[str]], tasks: list[tuple[str, int]]) -> list[str]:
    """Each task a process with its own TF_CONFIG; their stdout (NDJSON events)."""
    env = {key: value for key, value in os.environ.items() if key != "JOB_COMPLETION_INDEX"}
    env["DISTRUN_JOB_SECRET"] = secrets.token_hex(32)  # the deployment's, the same in every task
    procs = [subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}})})
             for kind, i in tasks]
    outs = [proc.communicate(timeout=240) for proc in procs]
    for (kind, i), proc, (_, err) in zip(tasks, procs, outs):
        assert proc.returncode == 0, f"{kind} {i}: {err[-2000:]}"
    return [out for out, _ in outs]


def _one_device(tmp_path: Path, batch: int) -> dict[str, torch.Tensor]:
    ckpt = tmp_path / "one-device"
    result = run_cli("train", str(tmp_path / "job" / "equiv.py"), "--strategy", "one-device", "--steps", "12",
                     "-b", str(batch), "--json", "--checkpoint-dir", str(ckpt))
    assert result.returncode == 0, result.stderr[-2000:]
    return torch.load(latest_checkpoint(ckpt), weights_only=True)["model"]


def _assert_same(trained: dict, alone: dict) -> None:
    for key, tensor in alone.items():
        torch.testing.assert_close(trained[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_chief_and_two_workers_from_tf_config_train_to_one_device(tmp_path):
    bundle, spec, recipe = _job(tmp_path, "multi-worker", replicas=1, batch=24)  # TF_CONFIG's 3 hosts win
    port = free_port()
    cluster = {"chief": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]}
    outs = _run_tasks(_node_argv(bundle, spec, recipe, tmp_path / "ckpt"), cluster,
                      [("worker", 1), ("chief", 0), ("worker", 0)])  # any start order
    done = {json.loads(line)["rank"]: json.loads(line) for out in outs for line in out.splitlines()
            if '"type": "done"' in line}
    assert sorted(done) == [0, 1, 2] and {event["steps"] for event in done.values()} == {12}
    # The chief's process ran rank 0: it hosted the rendezvous and wrote the checkpoint.
    assert any(json.loads(line).get("rank") == 0 for line in outs[1].splitlines() if '"type": "done"' in line)
    data = torch.load(latest_checkpoint(tmp_path / "ckpt"), weights_only=True)
    assert data["step"] == 12 and data["strategy"] == "multi-worker"
    _assert_same(data["model"], _one_device(tmp_path, 24))


def test_a_ps_task_from_tf_config_serves_parameter_server_workers(tmp_path):
    bundle, spec, recipe = _job(tmp_path, "parameter-server", replicas=2, batch=16, ps_tasks=1, ps_sync=True)
    port = free_port()
    cluster = {"chief": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:2223"], "ps": ["127.0.0.1:2224"]}
    outs = _run_tasks(_node_argv(bundle, spec, recipe, tmp_path / "ckpt"), cluster,
                      [("ps", 0), ("chief", 0), ("worker", 0)])
    ps_events = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    # The ps task's process ran one rank, the one after both workers, and it served them.
    assert {event["rank"] for event in ps_events if "rank" in event} == {2}, ps_events[-3:]
    served = [event for out in outs for line in out.splitlines() if line.startswith("{")
              for event in [json.loads(line)] if event.get("type") == "ps"]
    assert served and max(event["updates"] for event in served) == 12, served[-1:]
    data = torch.load(latest_checkpoint(tmp_path / "ckpt"), weights_only=True)
    assert data["step"] == 12 and data["strategy"] == "parameter-server"
    _assert_same(data["model"], _one_device(tmp_path, 16))  # synchronous rounds: one-device's update


def test_a_ps_task_from_tf_config_holds_the_hybrids_tables(tmp_path):
    """--embeddings ps from TF_CONFIG: the chief and a worker are the dense replicas, the ps entry
    the task holding the large table; they train to one-device's parameters."""
    recipe = REPO / "recipes" / "recommender.py"
    spec = build_spec(recipe=recipe, device="cpu", strategy="multi-worker", replicas=1, steps=8, epochs=None,
                      global_batch_size=None, seed=None, checkpoint_dir=None, checkpoint_every=None,
                      embeddings="ps", ps_tasks=1, ps_partition_mb=1.0)
    bundle = pack(recipe)
    (tmp_path / "bundle.tar.gz").write_bytes(bundle.data)
    (tmp_path / "job-spec.json").write_text(spec.to_json())
    port = free_port()
    cluster = {"chief": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:2223"], "ps": ["127.0.0.1:2224"]}
    outs = _run_tasks(_node_argv(tmp_path / "bundle.tar.gz", tmp_path / "job-spec.json", bundle.recipe,
                                 tmp_path / "ckpt"), cluster, [("ps", 0), ("worker", 0), ("chief", 0)])
    events = [json.loads(line) for out in outs for line in out.splitlines() if line.startswith("{")]
    placement = [event["line"] for event in events if event.get("type") == "output" and "[placement]" in event["line"]]
    assert any("ps0:" in line and "users.weight" in line for line in placement), placement
    served = [event for event in events if event.get("type") == "ps"]
    assert served and max(event["updates"] for event in served) == 8, served[-1:]  # one update a step
    one = run_cli("train", str(recipe), "--strategy", "one-device", "--steps", "8", "--json",
                  "--checkpoint-dir", str(tmp_path / "one-device"))
    assert one.returncode == 0, one.stderr[-2000:]
    data = torch.load(latest_checkpoint(tmp_path / "ckpt"), weights_only=True)
    assert data["step"] == 8
    _assert_same(data["model"], torch.load(latest_checkpoint(tmp_path / "one-device"), weights_only=True)["model"])


def test_an_evaluator_task_from_tf_config_evaluates_the_chiefs_checkpoints(tmp_path):
    """TF_CONFIG's evaluator entry: a chief and a worker train (a checkpoint every 4 steps in the
    folder they share with it), and the evaluator task, in no process group, evaluates the new
    checkpoints as they come and ends after the job's last step's, its figures the final
    checkpoint's model on eval_data."""
    recipe = tmp_path / "job" / "equiv.py"
    recipe.parent.mkdir()
    recipe.write_text(EQUIV)
    spec = build_spec(recipe=recipe, device="cpu", strategy="multi-worker", replicas=2, steps=12, epochs=None,
                      global_batch_size=16, seed=None, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=4)
    bundle = pack(recipe)
    (tmp_path / "bundle.tar.gz").write_bytes(bundle.data)
    (tmp_path / "job-spec.json").write_text(spec.to_json())
    cluster = {"chief": [f"127.0.0.1:{free_port()}"], "worker": ["127.0.0.1:2223"], "evaluator": ["127.0.0.1:2224"]}
    argv = _node_argv(tmp_path / "bundle.tar.gz", tmp_path / "job-spec.json", bundle.recipe, tmp_path / "ckpt")
    chief, worker, evaluator = _run_tasks(argv, cluster, [("chief", 0), ("worker", 0), ("evaluator", 0)])
    evals = [json.loads(line) for line in evaluator.splitlines() if '"type": "eval"' in line]
    assert evals and evals[-1]["step"] == 12, evals  # the last step's checkpoint, then the task ended
    assert [e["step"] for e in evals] == sorted({e["step"] for e in evals}) and {e["step"] for e in evals} <= {4, 8, 12}
    # The training's own evaluation at its end says the same of step 12's model.
    trained = [json.loads(line) for line in chief.splitlines() + worker.splitlines() if '"type": "eval"' in line]
    assert trained and trained[-1]["step"] == 12, trained
    assert evals[-1]["metrics"]["loss"] == pytest.approx(trained[-1]["metrics"]["loss"], rel=1e-5)
    # The figures: the final checkpoint's model on eval_data, here, in one process.
    module = runpy.run_path(str(recipe))
    model = module["model"]()
    model.load_state_dict(torch.load(latest_checkpoint(tmp_path / "ckpt"), weights_only=True)["model"])
    x, y = module["eval_data"](None).tensors
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x), y).item()
    assert evals[-1]["metrics"]["loss"] == pytest.approx(expected, rel=1e-5), (evals[-1], expected)


def test_an_evaluator_task_without_a_checkpoint_folder_is_one_line(tmp_path):
    bundle, spec, recipe = _job(tmp_path, "multi-worker", replicas=1, batch=16)
    result = run_cli("node", "--bundle", str(bundle), "--spec", str(spec), "--recipe", recipe,
                     env={"TF_CONFIG": json.dumps({"cluster": {"chief": ["127.0.0.1:2222"], "evaluator": ["b:1"]},
                                                   "task": {"type": "evaluator", "index": 0}}),
                          "DISTRUN_JOB_SECRET": secrets.token_hex(32)})
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.strip().splitlines() == [
        "error: TF_CONFIG: task.type evaluator needs the job's checkpoint folder (--checkpoint-dir, a volume the "
        "chief writes and this task reads)"], result.stderr


def _node_error(tmp_path: Path, tf_config: str, *flags: str) -> str:
    result = run_cli("node", "--bundle", str(tmp_path / "b.tar.gz"), "--spec", str(tmp_path / "s.json"),
                     "--recipe", "r.py", *flags, env={"TF_CONFIG": tf_config})
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("tf_config", "flags", "message"), [
    ("{not json", (), "error: TF_CONFIG: not valid JSON ("),
    ('{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 2}}', (),
     "error: TF_CONFIG: task.index 2, but cluster.worker has 2 entries"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}', (),
     "error: TF_CONFIG: cluster.worker[0] 'a': expected \"host:port\""),
    ('{"cluster": {"chief": ["a:1"], "master": ["b:2"]}, "task": {"type": "chief"}}', (),
     "error: TF_CONFIG: cluster.master: not a task type distrun knows"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}', ("--nnodes", "1"),
     "error: TF_CONFIG: set in the environment together with --nnodes; give one or the other"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}', ("--master-port", "29500"),
     "error: TF_CONFIG: set in the environment together with --master-port"),
])
def test_a_bad_tf_config_is_one_line_naming_it_and_the_key(tmp_path, tf_config, flags, message):
    assert _node_error(tmp_path, tf_config, *flags).startswith(message)
