"""Benchmarks: workloads (torch, run inside training processes) and their orchestrators (no torch)."""

__all__: list[str] = []
