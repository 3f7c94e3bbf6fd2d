"""``--tracker mlflow|wandb``: one job logs to both, read back with each tracker's own reader.

MLflow through ``MlflowClient`` on the job's sqlite store; W&B through ``wandb leet inspect
--json``, W&B's own reader of a run's ``.wandb`` transaction log (wandb 0.31 has no Python
``DataStore`` any more: the log is read by wandb-core). One training job, run once for the
module, carries both trackers; the other tests are the ways a tracker fails.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from distrun.errors import ConfigError
from distrun.runtime.tracking import RunParams
from tests.conftest import CliResult
from tests.integration._recipes import EQUIV, RAISES_IN_RANK_0, RAISES_IN_RANK_1

pytestmark = pytest.mark.integration

#: Parameters for a tracker started by a test itself, outside a job.
PARAMS = RunParams(strategy="sharded", replicas=2, world_size=2, hosts="localhost", global_batch_size=8,
                   precision="fp32", compile=False, compression="none", seed=0, steps=1, epochs=None,
                   recipe="r.py", recipe_sha256="0" * 64, distrun_version="0", torch_version="0",
                   python_version="3")
#: The same parameters, for a tracker started in a subprocess of its own.
PARAMS_SOURCE = ("from distrun.runtime.tracking import RunParams\n"
                 f"params = RunParams(**{dataclasses.asdict(PARAMS)!r})\n")


def distrun(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 240) -> CliResult:
    """The real CLI, from ``cwd`` (MLflow's default artifact root and W&B's folder are relative to it)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "distrun", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})
    return CliResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


def wandb_env(folder: Path) -> dict[str, str]:
    """W&B offline and quiet, its staging, cache and settings inside the test's folder."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DATA_DIR": str(folder / "wandb-data"),
            "WANDB_CACHE_DIR": str(folder / "wandb-cache"), "WANDB_CONFIG_DIR": str(folder / "wandb-config")}


class Job:
    """The module's one job: a fit recipe with eval_data, under mirrored x2, logged to both trackers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.recipe = root / "recipe.py"
        self.recipe.write_text(EQUIV)
        self.mlflow_uri = f"sqlite:///{root / 'mlflow.db'}"  # an absolute path: sqlite:////tmp/...
        self.wandb_dir = root / "wandb"
        self.result = distrun(
            "train", str(self.recipe), "--strategy", "mirrored", "--replicas", "2", "--device", "cpu",
            "--epochs", "2", "--log-interval-s", "0", "--json",
            "--tracker", "mlflow", "--tracker", "wandb", "--tracker-uri", f"mlflow={self.mlflow_uri}",
            "--tracker-uri", f"wandb={self.wandb_dir}", "--run-name", "run-1", "--experiment", "exp-1",
            "--checkpoint-dir", str(root / "ckpt"), "--tracker-checkpoint",
            cwd=root, env=wandb_env(root))
        lines = self.result.json_lines()
        self.steps = [line for line in lines if line["type"] == "step" and line["rank"] == 0]
        self.evals = [line for line in lines if line["type"] == "eval"]
        self.checkpoints = [line for line in lines if line["type"] == "checkpoint"]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    job = Job(tmp_path_factory.mktemp("tracking"))
    assert job.result.returncode == 0, job.result.stderr[-3000:]
    return job


@pytest.fixture(scope="module")
def mlflow_run(job):
    client = MlflowClient(job.mlflow_uri)
    experiment = client.get_experiment_by_name("exp-1")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_name for run in runs] == ["run-1"]  # rank 0 alone logged: one run for the job
    return client, runs[0]


def read_wandb(run_folder: Path) -> list[dict]:
    """The run's records, read by W&B's own reader: ``wandb leet inspect --json``, a line each."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", str(run_folder), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def wandb_records(job) -> list[dict]:
    folders = sorted((job.wandb_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 1, folders  # one W&B run for the job
    return read_wandb(folders[0])


def test_mlflow_gets_the_parameters(job, mlflow_run):
    _, run = mlflow_run
    params = run.data.params
    assert run.info.status == "FINISHED"
    assert params["strategy"] == "mirrored" and params["replicas"] == "2" and params["world_size"] == "2"
    assert params["recipe_sha256"] == hashlib.sha256(job.recipe.read_bytes()).hexdigest()
    assert params["recipe"] == "recipe.py" and params["epochs"] == "2" and params["global_batch_size"] == "16"
    assert params["torch_version"] == torch.__version__
    assert params["hosts"] in ("127.0.0.1", "localhost") and params["precision"] == "fp32"
    assert {"distrun_version", "python_version", "seed", "compile", "compression"} <= set(params)


def test_mlflow_gets_every_step_eval_and_the_summary(job, mlflow_run):
    client, run = mlflow_run
    run_id = run.info.run_id
    loss = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda metric: metric.step)
    assert [metric.step for metric in loss] == [line["step"] for line in job.steps]  # one per step event
    summary = job.result.summary
    assert loss[-1].value == pytest.approx(summary["final_loss"], rel=1e-6)
    learning_rate = client.get_metric_history(run_id, "train/learning_rate")
    assert len(learning_rate) == len(job.steps) and learning_rate[0].value == pytest.approx(0.01)
    accuracy = sorted(client.get_metric_history(run_id, "eval/accuracy"), key=lambda metric: metric.step)
    assert [metric.step for metric in accuracy] == [line["step"] for line in job.evals] == [7, 14]
    assert accuracy[-1].value == pytest.approx(job.evals[-1]["metrics"]["accuracy"])
    metrics = run.data.metrics
    assert metrics["summary/steps"] == summary["steps"] == 14
    assert metrics["summary/final_loss"] == pytest.approx(summary["final_loss"])
    assert metrics["summary/samples_per_s"] > 0 and metrics["summary/peak_mem_mb"] > 0


def test_mlflow_gets_the_newest_checkpoint(job, mlflow_run):
    client, run = mlflow_run
    newest = Path(job.checkpoints[-1]["path"])
    folder = f"checkpoints/{newest.stem}"
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id, "checkpoints")] == [folder]
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id, folder)] == \
        [f"{folder}/{newest.name}"]


def test_wandb_gets_config_history_summary_and_checkpoint(job, wandb_records):
    by_type: dict[str, list[dict]] = {}
    for record in wandb_records:
        by_type.setdefault(record["type"], []).append(record)
    run = by_type["run"][0]["run"]
    assert run["display_name"] == "run-1" and run["project"] == "exp-1"
    config = run["config"]["update"]
    assert config["strategy"] == "mirrored" and config["replicas"] == 2
    assert config["recipe_sha256"] == hashlib.sha256(job.recipe.read_bytes()).hexdigest()

    rows = [record["history"] for record in by_type["history"]]
    losses = [(row["step"]["num"], row["item"]["train/loss"]) for row in rows if "train/loss" in row["item"]]
    assert [step for step, _ in losses] == [line["step"] for line in job.steps]
    assert losses[-1][1] == pytest.approx(job.result.summary["final_loss"])
    assert [row["step"]["num"] for row in rows if "eval/accuracy" in row["item"]] == [7, 14]

    summary: dict = {}
    for record in by_type["summary"]:
        summary.update(record["summary"].get("update", {}))
    assert summary["final_loss"] == pytest.approx(job.result.summary["final_loss"])
    assert summary["steps"] == 14 and summary["peak_mem_mb"] > 0

    [artifact] = [record["artifact"] for record in by_type["artifact"]]
    newest = Path(job.checkpoints[-1]["path"])
    assert artifact["type"] == "model" and newest.stem in artifact["aliases"]
    assert [entry["path"] for entry in artifact["manifest"]["contents"]] == [newest.name]
    assert by_type["exit"][0]["exit"].get("exit_code", 0) == 0


@pytest.mark.parametrize("who", ["rank 0", "rank 1"])
def test_a_failed_job_ends_the_run_as_failed(tmp_path, who):
    """Rank 0 raises (its Failed event), or rank 1 does and the launcher stops rank 0 (SIGTERM)."""
    recipe = tmp_path / "raises.py"
    recipe.write_text(RAISES_IN_RANK_0 if who == "rank 0" else RAISES_IN_RANK_1)
    layout = (["--steps", "10"] if who == "rank 0"
              else ["--strategy", "mirrored", "--replicas", "2", "--device", "cpu"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = distrun("train", str(recipe), *layout, "--log-interval-s", "0", "--tracker", "mlflow",
                     "--tracker-uri", uri, "--experiment", "fails", cwd=tmp_path)
    assert result.returncode == 4, result.stderr[-2000:]
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("fails").experiment_id])
    assert run.info.status == "FAILED"
    if who == "rank 0":
        assert [metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]


def test_without_the_package_the_error_says_how_to_get_it(tmp_path):
    # A job whose ranks cannot import mlflow (a path entry that shadows it with an ImportError).
    shadow = tmp_path / "shadow"
    (shadow / "mlflow").mkdir(parents=True)
    (shadow / "mlflow" / "__init__.py").write_text("raise ImportError('no mlflow here')\n")
    recipe = tmp_path / "recipe.py"
    recipe.write_text(EQUIV)
    result = distrun("train", str(recipe), "--strategy", "mirrored", "--replicas", "2", "--device", "cpu",
                     "--steps", "3", "--tracker", "mlflow", cwd=tmp_path, env={"PYTHONPATH": str(shadow)})
    assert result.returncode == 2, result.stderr[-2000:]
    message = "--tracker mlflow needs the mlflow package on the chief host: pip install 'distrun[mlflow]'"
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("mlflow.db")) and not (tmp_path / "mlruns").exists()


def test_an_unreachable_tracking_server_fails_the_job_with_one_line(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    recipe = tmp_path / "recipe.py"
    recipe.write_text(EQUIV)
    result = distrun("train", str(recipe), "--steps", "3", "--tracker", "mlflow", "--tracker-uri",
                     f"http://127.0.0.1:{port}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--tracker mlflow: cannot reach the tracking server http://127.0.0.1:{port} from the chief host" \
        in result.stderr
    assert "Traceback" not in result.stderr and result.wall_s < 60  # not MLflow's minutes of retries


def test_a_sqlite_store_that_cannot_be_opened_fails_at_once():
    """MLflow itself would retry opening it for about a minute and a half."""
    from distrun.runtime.tracking._mlflow import MlflowTracker

    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        MlflowTracker("sqlite:////proc/no-such-dir/mlflow.db", "e", None).start(PARAMS)
    assert caught.value.message.startswith(
        "--tracker mlflow: cannot open the sqlite database /proc/no-such-dir/mlflow.db on the chief host: ")
    assert time.monotonic() - started < 20


def sharded_checkpoint(folder: Path) -> Path:
    """A folder like a sharded checkpoint's (``ckpt-N/``: shards and a sidecar)."""
    checkpoint = folder / "ckpt-000000001"
    checkpoint.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (checkpoint / name).write_bytes(b"shard")
    return checkpoint


def test_mlflow_logs_a_sharded_checkpoint_folder(tmp_path, monkeypatch):
    from distrun.runtime.tracking._mlflow import MlflowTracker

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, "folders", None)
    tracker.start(PARAMS)
    tracker.log_artifact(str(sharded_checkpoint(tmp_path)))
    tracker.finish(failed=False)
    client = MlflowClient(uri)
    listed = [artifact.path for artifact in client.list_artifacts(tracker.run_id, "checkpoints/ckpt-000000001")]
    assert sorted(listed) == [f"checkpoints/ckpt-000000001/{name}" for name in (".metadata", "__0_0.distcp",
                                                                               "__1_0.distcp")]
    assert client.get_run(tracker.run_id).data.params["strategy"] == "sharded"


def test_wandb_without_an_api_key_runs_offline_and_says_so(tmp_path):
    """No WANDB_MODE, no key, no netrc: an offline run folder and one note, never a login prompt.
    The run logs a sharded checkpoint's folder, its files under the folder's name."""
    checkpoint = sharded_checkpoint(tmp_path / "ckpt")
    code = PARAMS_SOURCE + (
        "from distrun.runtime.tracking._wandb import WandbTracker\n"
        f"tracker = WandbTracker({str(tmp_path / 'wb')!r}, 'p', 'r')\n"
        "tracker.start(params)\n"
        "tracker.log_metrics(1, {'train/loss': 1.0}, 0.0)\n"
        f"tracker.log_artifact({str(checkpoint)!r})\n"
        "tracker.finish(failed=False)\n"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env |= {"HOME": str(tmp_path), "NETRC": str(tmp_path / "no-netrc"), "WANDB_SILENT": "true",
            "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [folder] = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    note = f"[distrun] W&B: no API key here; offline run in {folder}, `wandb sync {folder}` uploads it"
    assert proc.stderr.count(note) == 1, proc.stderr
    records = read_wandb(folder)
    [artifact] = [record["artifact"] for record in records if record["type"] == "artifact"]
    assert sorted(entry["path"] for entry in artifact["manifest"]["contents"]) == \
        [f"ckpt-000000001/{name}" for name in (".metadata", "__0_0.distcp", "__1_0.distcp")]
