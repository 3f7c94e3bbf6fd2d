"""Where a cluster's hosts come from: the file's list (SSH, or this machine) or a Slurm allocation.

One ``Scheduler`` contract (``api.py``), one module per backend, as torchx does.
"""

from distrun.config import ClusterSpec
from distrun.scheduler.api import NoAllocation, Progress, Scheduler, quiet
from distrun.scheduler.slurm import SlurmScheduler
from distrun.scheduler.static import StaticHosts

__all__ = ["Scheduler", "NoAllocation", "Progress", "quiet", "SlurmScheduler", "StaticHosts", "scheduler_for", "resolve"]


def scheduler_for(cluster: ClusterSpec) -> Scheduler:
    return SlurmScheduler(cluster) if cluster.slurm is not None else StaticHosts(cluster)


def resolve(cluster: ClusterSpec, *, allocate: bool = False, progress: Progress = quiet) -> ClusterSpec:
    """The cluster with its hosts known (a Slurm allocation's nodes); a resolved cluster as it is."""
    if cluster.slurm is None or cluster.allocation is not None:
        return cluster
    return scheduler_for(cluster).resolve(allocate=allocate, progress=progress)
