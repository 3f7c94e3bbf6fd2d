"""Specs: frozen, validated values describing a job, a recipe and a cluster. Imports only errors."""

from distrun.config._hosts import DEFAULT_SSH_PORT, HostSpec, NetworkSpec, Role, SshSpec
from distrun.config.cluster import (
    Allocation,
    ClusterSpec,
    SlurmSpec,
    load_cluster,
    local_cluster,
    parse_cluster,
)
from distrun.config._compression import DEFAULT_POWERSGD_WARMUP, Compression
from distrun.config._diloco import DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DEFAULT_SYNC_EVERY, DILOCO_DEFAULTS, SYNC_DTYPES
from distrun.config.job import (
    DEFAULT_CPU_REPLICAS,
    DEFAULT_KEEP_CHECKPOINTS,
    DEFAULT_PS_PARTITION_MB,
    JobSpec,
    StrategyName,
    evaluator_spec,
    parse_elastic,
)
from distrun.config._observe import TRACKERS, check_trackers, parse_profile, parse_tracker_uris
from distrun.config.recipe import RecipeInfo, RecipeKind, inspect_recipe
from distrun.config._plan_probe import KEPT_LINK_KEYS, PLAN_PROBE_MARK, PLAN_PROBE_VAR, PlanProbeSpec, kept_links_valid
from distrun.config._predict import PREDICT_VAR, PredictSpec

__all__ = [
    "evaluator_spec",
    "DEFAULT_SSH_PORT",
    "Compression",
    "DEFAULT_POWERSGD_WARMUP",
    "DEFAULT_OUTER_LR",
    "DEFAULT_OUTER_MOMENTUM",
    "DEFAULT_SYNC_EVERY",
    "DILOCO_DEFAULTS",
    "SYNC_DTYPES",
    "Allocation",
    "ClusterSpec",
    "HostSpec",
    "SlurmSpec",
    "NetworkSpec",
    "Role",
    "SshSpec",
    "load_cluster",
    "local_cluster",
    "parse_cluster",
    "JobSpec",
    "StrategyName",
    "parse_elastic",
    "DEFAULT_CPU_REPLICAS",
    "DEFAULT_KEEP_CHECKPOINTS",
    "DEFAULT_PS_PARTITION_MB",
    "RecipeInfo",
    "RecipeKind",
    "inspect_recipe",
    "TRACKERS",
    "check_trackers",
    "parse_profile",
    "parse_tracker_uris",
    "PREDICT_VAR",
    "PlanProbeSpec",
    "KEPT_LINK_KEYS",
    "kept_links_valid",
    "PLAN_PROBE_VAR",
    "PLAN_PROBE_MARK",
    "PredictSpec",
]
