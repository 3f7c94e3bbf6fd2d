"""The contract every way of reaching hosts fulfils, as torchx has one Scheduler per backend.

A cluster file names its hosts (``StaticHosts``: SSH, or this machine for the
embedded default) or asks a scheduler for them (``SlurmScheduler``: an
allocation's nodes, reached through ``srun``). Everything above (up, status,
train, jobs, down) sees only a ``ClusterSpec`` whose hosts are known and a
``Remote`` per host, so no command knows which backend it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from distrun.config import ClusterSpec, HostSpec
from distrun.errors import HostError
from distrun.links import Remote, Result

__all__ = ["Progress", "Scheduler", "NoAllocation", "quiet"]

Progress = Callable[[str, str], None]
"""Called as ``progress(what, stage)``: a host's label, or the allocation's, and what it is doing."""


class NoAllocation(HostError):
    """The cluster's hosts are an allocation, and there is none (``distrun up`` asks for one)."""


def quiet(_what: str, _stage: str) -> None:
    pass


class Scheduler(Protocol):
    """Where a cluster's hosts come from, how each is reached, and how its server is started."""

    def resolve(self, *, allocate: bool = False, progress: Progress = quiet) -> ClusterSpec:
        """The cluster with its hosts filled in. ``allocate`` (``up``): ask for them if there are none."""
        ...

    def link(self, host: HostSpec) -> Remote:
        """A link to ``host`` of the resolved cluster (opened on first use)."""
        ...

    def start_server(self, remote: Remote, host: HostSpec, state_dir: str, config: dict[str, Any]) -> Result:
        """Start ``host``'s worker server so that it outlives this command; the start command's result."""
        ...

    def ended(self) -> str | None:
        """While a job runs: None while the hosts are there, else one line on why they are gone
        (a Slurm allocation cancelled, out of time, a node failed). Asked about once a second."""
        ...

    def close(self) -> None:
        """Close what ``ended()`` kept open between its calls."""
        ...

    def release(self) -> str | None:
        """``down``'s last step: give back what ``resolve(allocate=True)`` took; what was done, or None."""
        ...
