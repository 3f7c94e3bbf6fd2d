"""Specs: frozen, validated values describing a job and a recipe. Imports only errors."""

from distrun.config.job import DEFAULT_CPU_REPLICAS, DEFAULT_KEEP_CHECKPOINTS, JobSpec, StrategyName
from distrun.config.recipe import RecipeInfo, RecipeKind, inspect_recipe

__all__ = [
    "JobSpec",
    "StrategyName",
    "DEFAULT_CPU_REPLICAS",
    "DEFAULT_KEEP_CHECKPOINTS",
    "RecipeInfo",
    "RecipeKind",
    "inspect_recipe",
]
