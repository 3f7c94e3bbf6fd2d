"""TrackerTap: events in, tracker calls out, in order; a failing tracker never reaches training.

The trackers here are small recording classes that implement the ``Tracker`` protocol; the
real MLflow and W&B are exercised end to end in tests/integration/test_tracking.py.
"""

from __future__ import annotations

import threading
import json

import pytest

from distrun.errors import ConfigError
from distrun.protocol import Checkpointed, Done, Eval, Failed, Heartbeat, Log, MembershipChanged, Step
from distrun.runtime.tracking import RunParams, TrackerTap, worker_hosts

PARAMS = RunParams(strategy="mirrored", replicas=2, world_size=2, hosts="a,b", global_batch_size=16,
                   precision="fp32", compile=False, compression="none", seed=0, steps=None, epochs=2,
                   recipe="r.py", recipe_sha256="0" * 64, distrun_version="0.1.0", torch_version="2",
                   python_version="3.11")


class Recording:
    """A tracker that writes down each call (and fails the ones named in ``fail``)."""

    def __init__(self, name: str = "rec", fail: tuple[str, ...] = ()) -> None:
        self.name = name
        self.fail = fail
        self.calls: list[tuple] = []

    def _record(self, call: tuple) -> None:
        if call[0] in self.fail:
            raise RuntimeError(f"{call[0]} refused")
        self.calls.append(call)

    def start(self, params):
        self._record(("start", params.as_dict()))

    def log_metrics(self, step, metrics, wall_time_s):
        self._record(("log_metrics", step, dict(metrics)))

    def log_summary(self, summary):
        self._record(("log_summary", dict(summary)))

    def log_artifact(self, path):
        self._record(("log_artifact", path))

    def finish(self, failed):
        self._record(("finish", failed))


class Writer:
    def __init__(self) -> None:
        self.events: list = []

    def emit(self, event) -> None:
        self.events.append(event)


def _step(step: int, loss: float | None = 0.5) -> Step:
    return Step(rank=0, time=1.0, step=step, epoch=0, loss=loss, samples_per_s=100.0, mem_mb=1.0)


def test_events_become_metrics_summary_artifact_and_the_end(capfd):
    tracker, writer = Recording(), Writer()
    tap = TrackerTap(writer, [tracker], PARAMS, log_checkpoint=True)
    tap.learning_rate = lambda: 0.01
    events = [_step(1), _step(2, loss=None), Log(rank=0, time=1.0, step=2, scalars={"loss_scale": 8.0}),
              Eval(rank=0, time=1.0, step=2, epoch=0, metrics={"accuracy": 0.5}),
              MembershipChanged(rank=0, time=1.0, generation=1, step=2, world_size=3),
              Checkpointed(rank=0, time=1.0, step=2, path="/c/ckpt-000000002.pt"),
              Checkpointed(rank=0, time=1.0, step=1, path="/c/ckpt-000000001.pt"),  # an older one, reported late
              Heartbeat(rank=0, time=1.0, where="distrun"),
              Done(rank=0, time=2.0, steps=2, final_loss=0.25, samples_per_s=90.0, first_step_time=1.0,
                   peak_mem_mb=None)]
    for event in events:
        tap.emit(event)
    tap.close()
    tap.close()  # atexit may run it after an explicit close: once is enough
    assert writer.events == events  # every event goes on unchanged
    assert tracker.calls == [
        ("start", PARAMS.as_dict()),
        ("log_metrics", 1, {"train/samples_per_s": 100.0, "train/loss": 0.5, "train/learning_rate": 0.01}),
        ("log_metrics", 2, {"train/samples_per_s": 100.0, "train/learning_rate": 0.01}),
        ("log_metrics", 2, {"loss_scale": 8.0}),
        ("log_metrics", 2, {"eval/accuracy": 0.5}),
        ("log_metrics", 3, {"membership/world_size": 3.0}),
        ("log_summary", {"steps": 2.0, "final_loss": 0.25, "samples_per_s": 90.0}),
        ("log_artifact", "/c/ckpt-000000002.pt"),
        ("finish", False),
    ]
    assert capfd.readouterr().err == ""


def test_a_failing_tracker_is_reported_once_and_training_goes_on(capfd):
    broken, working = Recording("broken", fail=("log_metrics", "log_summary")), Recording("working")
    tap = TrackerTap(Writer(), [broken, working], PARAMS)
    for step in range(1, 4):
        tap.emit(_step(step))
    tap.emit(Done(rank=0, time=2.0, steps=3, final_loss=0.5, samples_per_s=1.0, first_step_time=1.0))
    tap.close()
    assert [call[0] for call in working.calls] == ["start", "log_metrics", "log_metrics", "log_metrics",
                                                   "log_summary", "finish"]
    assert broken.calls[-1] == ("finish", False)
    err = capfd.readouterr().err
    assert err == ("[distrun] --tracker broken: log_metrics failed (RuntimeError: log_metrics refused); "
                   "training goes on, later failures of broken are not shown\n")


def test_a_learning_rate_that_cannot_be_read_is_reported_once_and_the_steps_go_on(capfd):
    tracker = Recording()
    tap = TrackerTap(Writer(), [tracker], PARAMS)
    tap.learning_rate = lambda: {}["lr"]  # as an optimizer whose param group lost its "lr"
    for step in range(1, 4):
        tap.emit(_step(step))
    tap.close()
    assert [call for call in tracker.calls if call[0] == "log_metrics"] == [
        ("log_metrics", step, {"train/samples_per_s": 100.0, "train/loss": 0.5}) for step in range(1, 4)]
    assert capfd.readouterr().err == (
        "[distrun] --tracker rec: reading the learning rate failed (KeyError: 'lr'); train/learning_rate is "
        "not logged while it fails, later failures are not shown\n")


def test_a_failure_ends_the_runs_before_the_launcher_hears_of_it():
    tracker = Recording()

    class Watching(Writer):
        def emit(self, event) -> None:
            if isinstance(event, Failed):
                assert tracker.calls[-1] == ("finish", True)  # already ended when the event goes on
            super().emit(event)

    writer = Watching()
    tap = TrackerTap(writer, [tracker], PARAMS, log_checkpoint=True)
    tap.emit(Checkpointed(rank=0, time=1.0, step=1, path="/c/ckpt-000000001.pt"))
    tap.emit(Failed(rank=0, time=1.0, kind="raised", message="ValueError: boom"))
    tap.emit(_step(2))  # nothing is logged after the end
    tap.close()  # no artifact: the job is not done
    assert [call[0] for call in tracker.calls] == ["start", "finish"]
    assert [type(event) for event in writer.events] == [Checkpointed, Failed, Step]


def test_a_tracker_that_cannot_start_ends_those_started_before_it():
    first = Recording("first")

    class Refusing(Recording):
        def start(self, params):
            raise ConfigError("--tracker refusing: cannot start a run")

    with pytest.raises(ConfigError, match="cannot start a run"):
        TrackerTap(Writer(), [first, Refusing("refusing")], PARAMS)
    assert first.calls == [("start", PARAMS.as_dict()), ("finish", True)]


def test_the_learning_rate_reaches_a_tap_underneath():
    class Board(Writer):  # as TensorBoardTap: a learning_rate attribute the fit loop sets
        learning_rate = None

    board = Board()
    tap = TrackerTap(board, [Recording()], PARAMS)
    source = lambda: 0.1  # noqa: E731
    tap.learning_rate = source
    assert tap.learning_rate is source and board.learning_rate is source
    plain = TrackerTap(Writer(), [Recording()], PARAMS)
    plain.learning_rate = source  # an EventWriter has no such attribute, and gets none
    assert not hasattr(plain._writer, "learning_rate")
    tap.close()
    plain.close()


@pytest.mark.parametrize("tf_config, hosts", [
    ({"cluster": {"worker": ["gpu-1:29500", "gpu-1:29500", "gpu-2:29500"]}}, ("gpu-1", "gpu-2")),
    ({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:1"], "ps": ["10.0.0.9:1"]}}, ("127.0.0.1",)),
    ({"cluster": {"worker": ["[::1]:29500"]}}, ("::1",)),
    (None, ("localhost",)),
    ({"task": {}}, ("localhost",)),
])
def test_hosts_come_from_tf_config(tf_config, hosts):
    assert worker_hosts(json.dumps(tf_config) if tf_config is not None else None) == hosts


def test_params_leave_out_what_has_no_value():
    assert "steps" not in PARAMS.as_dict() and PARAMS.as_dict()["epochs"] == 2


def test_per_step_metrics_are_dropped_not_queued_while_a_tracker_is_far_behind(monkeypatch):
    from distrun.runtime.tracking import _calls

    monkeypatch.setattr(_calls, "MAX_PENDING_CALLS", 3)
    gate, made, reports = threading.Event(), [], []
    calls = _calls.TrackerCalls(report=reports.append)
    calls.submit("mlflow", "slow server", gate.wait, 10)
    for step in range(5):
        calls.submit("mlflow", "log_metrics", made.append, step, droppable=True)
    calls.submit("mlflow", "finish", made.append, "end")  # the run's end is never dropped
    gate.set()
    assert calls.drain(10)
    assert made == [0, 1, "end"]
    assert reports == ["--tracker mlflow: 3 calls behind; per-step metrics are dropped until it catches up"]


def test_credentials_in_a_tracking_uri_never_reach_a_message():
    from distrun.runtime.tracking._calls import one_line, redact

    assert redact("http://alice:s3cret@mlflow.lab:5000") == "http://***@mlflow.lab:5000"
    assert "s3cret" not in one_line(RuntimeError("cannot connect to postgresql://bob:s3cret@db/mlflow"))
    assert redact("sqlite:////srv/mlflow.db") == "sqlite:////srv/mlflow.db"
