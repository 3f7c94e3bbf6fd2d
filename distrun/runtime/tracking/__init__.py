"""``--tracker mlflow|wandb``: rank 0 logs the run to experiment trackers (docs/tracking.md).

``api`` says what a tracker is (``Tracker``) and what every run is logged with
(``RunParams``); ``_mlflow`` and ``_wandb`` are the two trackers, each importing its package
only when its run starts; ``tap`` is the tap on rank 0's event writer that translates events
into tracker calls, which ``_calls`` makes on a thread of their own.
"""

from distrun.runtime.tracking.api import RunParams, Tracker, worker_hosts
from distrun.runtime.tracking.tap import TrackerTap, tracker_tap

__all__ = ["RunParams", "Tracker", "TrackerTap", "tracker_tap", "worker_hosts"]
