"""``--tracker mlflow``: one MLflow run, written through ``MlflowClient``.

The client, not MLflow's fluent API (``mlflow.start_run``): the fluent API keeps an active
run in process-wide state that a recipe logging to MLflow itself would share and end. The
client writes only the run it created. mlflow is imported when the run starts, never at
import, so a job without ``--tracker mlflow`` does not need it.
"""

from __future__ import annotations

import socket
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from distrun.errors import ConfigError
from distrun.runtime.tracking._calls import one_line, redact
from distrun.runtime.tracking.api import RunParams

__all__ = ["MlflowTracker", "DEFAULT_EXPERIMENT"]

#: ``--experiment`` not given: MLflow's own default experiment.
DEFAULT_EXPERIMENT = "Default"
#: An http(s) tracking server is dialled once before the run starts (``_check_store``).
_REACH_TIMEOUT_S = 10.0


class MlflowTracker:
    name = "mlflow"

    def __init__(self, uri: str | None, experiment: str | None, run_name: str | None) -> None:
        """``uri``: MLflow's tracking URI; None: MLflow's default (MLFLOW_TRACKING_URI, else
        ``mlflow.db`` in rank 0's working folder)."""
        self.uri = uri
        self.experiment = experiment or DEFAULT_EXPERIMENT
        self.run_name = run_name
        self._client: Any = None
        self.run_id: str | None = None

    def start(self, params: RunParams) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient, get_tracking_uri
        except ImportError:
            raise ConfigError("--tracker mlflow needs the mlflow package on the chief host: "
                              "pip install 'distrun[mlflow]'") from None
        where = self.uri or get_tracking_uri()  # MLflow's default, resolved as its client resolves it
        try:
            _check_store(where)
            self._client = MlflowClient(tracking_uri=self.uri)
            experiment_id = self._experiment_id()
            run = self._client.create_run(experiment_id, run_name=self.run_name,
                                          tags={"mlflow.source.name": params.recipe, "mlflow.source.type": "LOCAL"})
            self.run_id = run.info.run_id
            self._client.log_batch(self.run_id, params=[Param(key, str(value))
                                                        for key, value in params.as_dict().items()])
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - MLflow, SQLAlchemy and requests each raise their own
            raise ConfigError(f"--tracker mlflow: cannot start a run at {redact(where)}: {one_line(exc)}") from None

    def log_metrics(self, step: int, metrics: Mapping[str, float], wall_time_s: float) -> None:
        from mlflow.entities import Metric

        stamp_ms = int(wall_time_s * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(key, float(value), stamp_ms, step)
                                                     for key, value in metrics.items()])

    def log_summary(self, summary: Mapping[str, float]) -> None:
        """``summary/<name>`` metrics, at the run's last step (MLflow has no summary of its own)."""
        step = int(summary.get("steps", 0))
        self.log_metrics(step, {f"summary/{key}": value for key, value in summary.items()}, time.time())

    def log_artifact(self, path: str) -> None:
        """Under ``checkpoints/ckpt-N``: the file itself, or the folder's contents."""
        local = Path(path)
        artifact_path = f"checkpoints/{local.name.removesuffix('.pt')}"
        if local.is_dir():
            self._client.log_artifacts(self.run_id, str(local), artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(local), artifact_path)

    def finish(self, failed: bool) -> None:
        self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")

    def _experiment_id(self) -> str:
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self._client.create_experiment(self.experiment))
        except Exception:  # another job created it first
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return str(found.experiment_id)


def _check_store(uri: str | None) -> None:
    """Fail in seconds where MLflow would retry for minutes: an http(s) tracking server that
    refuses the connection (about four minutes of retries), a sqlite file that cannot be
    opened (about a minute and a half)."""
    if not uri:
        return
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            socket.create_connection((parts.hostname or "", port), timeout=_REACH_TIMEOUT_S).close()
        except OSError as exc:
            raise ConfigError(f"--tracker mlflow: cannot reach the tracking server {redact(uri)} from the chief host: "
                              f"{exc.strerror or exc}") from None
    elif parts.scheme == "sqlite" and uri.startswith("sqlite:///") and ":memory:" not in uri:
        path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # as MLflow does
            sqlite3.connect(path).close()
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"--tracker mlflow: cannot open the sqlite database {path} on the chief host: "
                              f"{exc}") from None
