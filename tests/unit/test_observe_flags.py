"""``--profile`` and ``--tracker*`` parsed and checked (config/_observe.py), and the CLI's
``--tracker tensorboard``, which is ``--tensorboard`` (cli/train.py's ``observe_flags``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distrun.cli.train import observe_flags
from distrun.config import JobSpec
from distrun.config._observe import check_profile, check_trackers, parse_profile, parse_tracker_uris
from distrun.errors import ConfigError, UsageError


@pytest.mark.parametrize("text, window", [("10:12", (10, 12)), ("5", (5, 5)), ("1:1", (1, 1)), (" 2:3", (2, 3))])
def test_profile_windows(text, window):
    assert parse_profile(text) == window


@pytest.mark.parametrize("text, message", [
    ("a:b", "--profile: expected START:END global steps (e.g. 10:12). Received: 'a:b'"),
    ("3:", "--profile: expected START:END global steps (e.g. 10:12). Received: '3:'"),
    ("", "--profile: expected START:END global steps (e.g. 10:12). Received: ''"),
    ("0:3", "--profile 0:3: needs 1 <= START <= END (global steps, the first is 1)"),
    ("5:3", "--profile 5:3: needs 1 <= START <= END (global steps, the first is 1)"),
])
def test_bad_profile_windows(text, message):
    with pytest.raises(ConfigError) as caught:
        parse_profile(text)
    assert caught.value.message == message


@pytest.mark.parametrize("window", [(1,), (True, 2), (1.0, 2)])
def test_a_spec_window_must_be_two_whole_steps(window):
    with pytest.raises(ConfigError) as caught:
        check_profile(window)
    assert caught.value.message == f"--profile: expected two whole steps START:END. Received: {window!r}"
    check_profile(None)


@pytest.mark.parametrize("values, trackers, uris", [
    ([], ("mlflow",), {}),
    (["sqlite:////tmp/m.db"], ("mlflow",), {"mlflow": "sqlite:////tmp/m.db"}),
    (["sqlite:///x.db?a=b"], ("mlflow",), {"mlflow": "sqlite:///x.db?a=b"}),  # an "=" in a bare URI
    (["mlflow=http://h:5000", "wandb=/tmp/w"], ("mlflow", "wandb"), {"mlflow": "http://h:5000", "wandb": "/tmp/w"}),
    (["wandb=/tmp/w"], ("mlflow", "wandb"), {"wandb": "/tmp/w"}),
    (["tensorboard=runs/a"], ("tensorboard",), {"tensorboard": "runs/a"}),
])
def test_tracker_uris(values, trackers, uris):
    assert parse_tracker_uris(values, trackers) == uris


@pytest.mark.parametrize("values, trackers, message", [
    (["sqlite:///m.db"], ("mlflow", "wandb"),
     "--tracker-uri sqlite:///m.db: with 2 trackers, name the one it is for (--tracker-uri mlflow=URI)"),
    (["sqlite:///m.db"], (), "--tracker-uri sqlite:///m.db: needs --tracker mlflow|wandb|tensorboard"),
    (["mlflow="], ("mlflow",), "--tracker-uri mlflow=: empty URI"),
    (["mlflow=a", "mlflow=b"], ("mlflow",), "--tracker-uri: given twice for mlflow"),
    (["a", "b"], ("mlflow",), "--tracker-uri: given twice for mlflow"),
])
def test_bad_tracker_uris(values, trackers, message):
    with pytest.raises(ConfigError) as caught:
        parse_tracker_uris(values, trackers)
    assert caught.value.message == message


def _check(trackers=(), uris=None, *, run_name=None, experiment=None, log_checkpoint=False, checkpoint_dir=None):
    check_trackers(tuple(trackers), uris or {}, run_name=run_name, experiment=experiment,
                   log_checkpoint=log_checkpoint, checkpoint_dir=checkpoint_dir)


@pytest.mark.parametrize("kwargs", [
    {},
    {"trackers": ("mlflow", "wandb", "tensorboard")},
    {"trackers": ("mlflow", "wandb"), "uris": {"mlflow": "sqlite:///m.db", "wandb": "/w"}},
    {"trackers": ("wandb",), "run_name": "r", "experiment": "e", "log_checkpoint": True, "checkpoint_dir": "/c"},
    {"trackers": ("tensorboard",), "run_name": "r"},
])
def test_good_tracker_flags(kwargs):
    _check(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"trackers": ("mlfow",)},
     "--tracker: unknown tracker 'mlfow' (did you mean 'mlflow'?); choose mlflow, wandb, tensorboard"),
    ({"trackers": ("comet",)}, "--tracker: unknown tracker 'comet'; choose mlflow, wandb, tensorboard"),
    ({"trackers": ("mlflow", "mlflow")}, "--tracker: each tracker once. Received: mlflow, mlflow"),
    ({"trackers": ("mlflow",), "uris": {"wandb": "/w"}}, "--tracker-uri wandb=...: needs --tracker wandb"),
    ({"run_name": "r"}, "--run-name needs --tracker mlflow|wandb|tensorboard"),
    ({"experiment": "e"}, "--experiment needs --tracker mlflow|wandb|tensorboard"),
    ({"log_checkpoint": True, "checkpoint_dir": "/c"},
     "--tracker-checkpoint needs --tracker mlflow|wandb|tensorboard"),
    ({"trackers": ("mlflow",), "log_checkpoint": True},
     "--tracker-checkpoint needs --checkpoint-dir: it logs the newest checkpoint written there"),
    ({"trackers": ("tensorboard",), "log_checkpoint": True, "checkpoint_dir": "/c"},
     "--tracker-checkpoint: TensorBoard keeps no artifacts; use --tracker mlflow or wandb"),
])
def test_bad_tracker_flags(kwargs, message):
    with pytest.raises(ConfigError) as caught:
        _check(**kwargs)
    assert caught.value.message == message


def test_the_job_spec_checks_the_trackers_and_carries_them_through_json():
    spec = JobSpec.of(recipe="/r.py", trackers=("mlflow", "wandb"), tracker_uris={"mlflow": "sqlite:////m.db"},
                   run_name="r", experiment="e", tracker_checkpoint=True, checkpoint_dir="/c")
    assert JobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ConfigError, match="--tracker-uri wandb=...: needs --tracker wandb"):
        JobSpec.of(recipe="/r.py", trackers=("mlflow",), tracker_uris={"wandb": "/w"})


def _observe(tmp_path: Path, **flags):
    values = {"profile": None, "trackers": [], "tracker_uris": [], "run_name": None, "experiment": None,
              "tracker_checkpoint": False, "tensorboard": None, "checkpoint_dir": None,
              "results_dir": tmp_path / "results", "local": True} | flags
    return observe_flags(**values)


def test_tracker_tensorboard_is_the_tensorboard_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fields = _observe(tmp_path, trackers=["tensorboard"])
    assert fields["tensorboard_dir"] == str(tmp_path / "runs")  # the default folder, ./runs
    assert fields["trackers"] == () and fields["tracker_uris"] == {}

    fields = _observe(tmp_path, trackers=["mlflow", "tensorboard"], run_name="r",
                      tracker_uris=["mlflow=sqlite:///m.db", "tensorboard=tb"])
    assert fields["tensorboard_dir"] == str(tmp_path / "tb" / "r")  # a run's folder under TensorBoard's
    assert fields["trackers"] == ("mlflow",) and fields["tracker_uris"] == {"mlflow": "sqlite:///m.db"}
    assert fields["run_name"] == "r"

    same = _observe(tmp_path, trackers=["tensorboard"], tracker_uris=["tb"], tensorboard=tmp_path / "tb")
    assert same["tensorboard_dir"] == str(tmp_path / "tb")  # both flags naming one folder

    fields = _observe(tmp_path, tensorboard=Path("board"))
    assert fields["tensorboard_dir"] == str(tmp_path / "board") and fields["trackers"] == ()


def test_tensorboard_alone_takes_a_run_name_and_refuses_a_checkpoint(tmp_path, monkeypatch):
    """The flags are checked as given, before --tracker tensorboard becomes --tensorboard."""
    monkeypatch.chdir(tmp_path)
    fields = _observe(tmp_path, trackers=["tensorboard"], run_name="lr-0.1", experiment="e")
    assert fields["tensorboard_dir"] == str(tmp_path / "runs" / "lr-0.1") and fields["trackers"] == ()
    spec = JobSpec.of(recipe="/r.py", **{k: v for k, v in fields.items() if k not in ("profile_steps", "profile_dir")})
    assert spec.observe.run_name == "lr-0.1"  # a spec with TensorBoard only still carries the run's name
    with pytest.raises(ConfigError) as caught:
        _observe(tmp_path, trackers=["tensorboard"], tracker_checkpoint=True, checkpoint_dir=tmp_path / "c")
    assert caught.value.message == "--tracker-checkpoint: TensorBoard keeps no artifacts; use --tracker mlflow or wandb"
    with pytest.raises(ConfigError) as caught:
        _observe(tmp_path, run_name="r")
    assert caught.value.message == "--run-name needs --tracker mlflow|wandb|tensorboard"


def test_a_profile_window_past_the_last_step_is_refused():
    with pytest.raises(ConfigError) as caught:
        JobSpec.of(recipe="/r.py", steps=50, profile_steps=(100, 110))
    assert caught.value.message == "--profile 100:110: the job takes 50 step(s), so the window would never open"
    assert JobSpec.of(recipe="/r.py", steps=50, profile_steps=(50, 60)).observe.profile_steps == (50, 60)


def test_tensorboard_and_tracker_tensorboard_must_name_one_folder(tmp_path):
    with pytest.raises(UsageError) as caught:
        _observe(tmp_path, trackers=["tensorboard"], tracker_uris=[str(tmp_path / "a")], tensorboard=tmp_path / "b")
    assert caught.value.message == (f"--tensorboard {tmp_path / 'b'} and --tracker tensorboard ({tmp_path / 'a'}): "
                                    "one folder, please")


def test_profile_traces_go_beside_the_checkpoints_or_into_the_results(tmp_path):
    fields = _observe(tmp_path, profile="3:4", checkpoint_dir=tmp_path / "ckpt")
    assert fields["profile_steps"] == (3, 4) and fields["profile_dir"] == str(tmp_path / "ckpt" / "profile")
    fields = _observe(tmp_path, profile="2")
    assert Path(fields["profile_dir"]).parent.parent == tmp_path / "results"
    assert _observe(tmp_path, profile="2", local=False)["profile_dir"] is None
    assert _observe(tmp_path)["profile_steps"] is None
