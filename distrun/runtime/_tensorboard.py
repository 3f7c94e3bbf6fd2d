"""``--tensorboard DIR``: TensorBoard event files, written beside the job's own events.

A tap on a training process's event writer: what the chief (rank 0) and each ps task send
to the launcher is also written as TensorBoard scalars, so TensorBoard shows exactly what
the live view showed, and no recipe changes. Keras, Lightning and TF Estimators all
write event files; a distrun job does too.

- Rank 0, into DIR: ``train/loss``, ``train/samples_per_s``, ``train/learning_rate`` at
  each step event (throttled as the live view is), ``eval/<metric>`` after each
  evaluation, every ``strategy.log`` scalar under its own name (fp16's ``loss_scale``
  included), and under ``--elastic``, ``membership/world_size``.
- Each ps task, into DIR/ps<N>: ``ps/updates``, ``ps/bytes_in``, ``ps/bytes_out``,
  ``ps/params``, ``ps/workers``.

Written with the ``tensorboard`` package's own writer (``pip install distrun[tensorboard]``),
so its own reader reads them. On a cluster, DIR is the job's folder on the chief's host,
and the files come home with the results (docs/tensorboard.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrun.errors import ConfigError
from distrun.protocol import Eval, Event, Log, MembershipChanged, PsStats, Step

__all__ = ["TensorBoardTap"]


class TensorBoardTap:
    """Wraps an EventWriter: ``emit`` sends the event on and writes its figures to ``logdir``."""

    def __init__(self, writer: Any, logdir: str | Path) -> None:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package on every training host: "
                              "pip install 'distrun[tensorboard]'") from None
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = writer
        self._events = EventFileWriter(str(logdir), max_queue_size=100, flush_secs=2)
        self.learning_rate: Any = None  # a callable the fit loop sets: the optimizer's current lr

    def emit(self, event: Event) -> None:
        self._writer.emit(event)
        for tag, value, step in _scalars(event):
            self._scalar(tag, value, step, event.time)
        if isinstance(event, Step) and self.learning_rate is not None:
            self._scalar("train/learning_rate", float(self.learning_rate()), event.step, event.time)

    def close(self) -> None:
        self._events.close()

    def _scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as TbEvent
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self._events.add_event(TbEvent(wall_time=wall_time, step=step, summary=summary))


def _scalars(event: Event) -> list[tuple[str, float, int]]:
    if isinstance(event, Step):
        found = [("train/samples_per_s", event.samples_per_s, event.step)]
        if event.loss is not None:
            found.append(("train/loss", event.loss, event.step))
        return found
    if isinstance(event, Log):
        return [(name, value, event.step) for name, value in event.scalars.items()]
    if isinstance(event, Eval):
        return [(f"eval/{name}", value, event.step) for name, value in event.metrics.items()]
    if isinstance(event, MembershipChanged):
        return [("membership/world_size", float(event.world_size), event.step + 1)]
    if isinstance(event, PsStats):
        return [(f"ps/{name}", float(getattr(event, name)), event.updates)
                for name in ("updates", "bytes_in", "bytes_out", "params", "workers")]
    return []
