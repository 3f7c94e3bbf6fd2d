"""Specs: frozen, validated values describing a job, a recipe and a cluster. Imports only errors."""

from distrun.config.cluster import (
    ClusterSpec,
    HostSpec,
    NetworkSpec,
    Role,
    SshSpec,
    load_cluster,
    local_cluster,
    parse_cluster,
)
from distrun.config.job import DEFAULT_CPU_REPLICAS, DEFAULT_KEEP_CHECKPOINTS, JobSpec, StrategyName
from distrun.config.recipe import RecipeInfo, RecipeKind, inspect_recipe

__all__ = [
    "ClusterSpec",
    "HostSpec",
    "NetworkSpec",
    "Role",
    "SshSpec",
    "load_cluster",
    "local_cluster",
    "parse_cluster",
    "JobSpec",
    "StrategyName",
    "DEFAULT_CPU_REPLICAS",
    "DEFAULT_KEEP_CHECKPOINTS",
    "RecipeInfo",
    "RecipeKind",
    "inspect_recipe",
]
