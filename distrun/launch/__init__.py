"""Starting and supervising training processes; shared by local mode and the worker server."""

from distrun.launch._devices import visible_gpu_count
from distrun.launch._starter import PopenStarter, Starter, ZygoteStarter, ZygoteUnavailable
from distrun.launch.api import PEER_LOST, ProcessState, RunResult, WorkerSpec
from distrun.launch.local import EventSink, LocalLauncher

__all__ = [
    "WorkerSpec",
    "RunResult",
    "ProcessState",
    "PEER_LOST",
    "LocalLauncher",
    "EventSink",
    "visible_gpu_count",
    "Starter",
    "PopenStarter",
    "ZygoteStarter",
    "ZygoteUnavailable",
]
