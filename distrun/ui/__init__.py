"""Terminal rendering: rich renderables built from immutable snapshots, nothing else."""

from distrun.ui._format import fmt_ranks
from distrun.ui.cluster import render_cluster
from distrun.ui.diagnosis import render_diagnosis
from distrun.ui.train import render_progress, render_summary

__all__ = ["render_progress", "render_summary", "render_cluster", "render_diagnosis", "fmt_ranks"]
