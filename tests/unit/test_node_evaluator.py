"""TF_CONFIG's evaluator task without a training beside it (issue 51): what it reads as a published
checkpoint, and how it ends when none comes or it is told to stop. Its evaluations themselves run
in tests/integration/test_tf_config.py, beside a chief and a worker."""

from __future__ import annotations

import time
from pathlib import Path

from distrun.cli import _node_evaluator
from distrun.cli._node_evaluator import evaluate_checkpoints
from distrun.config import JobSpec, StrategyName


def _spec(folder: Path) -> JobSpec:
    return JobSpec.of("/r.py", strategy=StrategyName.MULTI_WORKER, steps=12, checkpoint_dir=str(folder))


def _never(*_args: object) -> str:
    raise AssertionError("nothing was to be evaluated")


def test_published_checkpoints_are_the_renamed_ones_plain_or_sharded_oldest_first(tmp_path):
    for name in ("ckpt-000000008", "ckpt-000000004.pt", ".tmp-ckpt-000000012", "ckpt-000000012.pt.partial", "notes"):
        (tmp_path / name).mkdir() if "." not in name or name.startswith(".tmp") else (tmp_path / name).touch()
    assert _node_evaluator._published(tmp_path) == [(4, tmp_path / "ckpt-000000004.pt"), (8, tmp_path / "ckpt-000000008")]
    assert _node_evaluator._published(tmp_path / "absent") == []


def test_with_no_checkpoint_it_ends_after_its_idle_time_and_at_once_when_told(tmp_path, monkeypatch):
    monkeypatch.setattr(_node_evaluator, "POLL_S", 0.05)
    started = time.monotonic()
    assert evaluate_checkpoints(_spec(tmp_path), tmp_path, _never, secret="", idle_s=0.3, describe_failure=_never,
                                work=tmp_path) == 0
    assert 0.3 <= time.monotonic() - started < 5
    started = time.monotonic()
    assert evaluate_checkpoints(_spec(tmp_path), tmp_path, _never, secret="", idle_s=600, describe_failure=_never,
                                work=tmp_path, stopped=lambda: True) == 0
    assert time.monotonic() - started < 1
