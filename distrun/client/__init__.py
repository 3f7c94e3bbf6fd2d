"""Driving jobs and clusters from the user's machine (no torch here)."""

from distrun.client._tracker import JobTracker
from distrun.client._bundle import Bundle, pack
from distrun.client.cluster import Progress, cluster_down, cluster_status, cluster_up
from distrun.client.cluster_job import ClusterJob
from distrun.client._job_env import JobEnvironment
from distrun.client.local import JobOutcome, LocalJob

__all__ = ["ClusterJob", "JobEnvironment", "Bundle", "pack", "LocalJob", "JobOutcome", "JobTracker", "cluster_up", "cluster_status", "cluster_down", "Progress"]
