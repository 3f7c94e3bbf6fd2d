"""Which ranks shard together: over every rank, or inside each host (HSDP), and the mesh for it.

``--shard-within all`` shards every tensor over all N ranks: the least memory per rank, and
every all-gather and reduce-scatter crosses hosts. ``host`` is HSDP: shards inside each host's
k ranks and replicates across hosts (a 2-D mesh), so the per-block collectives stay on the
fast links inside a host and only the gradients' all-reduce crosses hosts, at k/N times the
memory saving. ``auto`` (the default) takes HSDP on a cluster of 2 or more hosts when the
model fits that way, which is what torchtitan and Accelerate advise for multi-host jobs.

"Fits" is an estimate made before anything is allocated: 16 bytes per parameter (fp32
weights and gradients, and an Adam-like optimizer's two moments), divided over a host's k
ranks, against half of each rank's memory (a GPU's total, or the host's available RAM shared
by its ranks); the other half is left to activations and buffers. Every rank must agree, so
the verdict is all-reduced (the least memory decides) before the mesh is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from distrun.errors import ConfigError

__all__ = ["BYTES_PER_PARAMETER", "Layout", "choose_layout"]

#: fp32 parameter + gradient + two optimizer moments.
BYTES_PER_PARAMETER = 16
#: Of a rank's memory, what the model state may take before HSDP is judged not to fit.
_STATE_SHARE = 0.5


@dataclass(frozen=True)
class Layout:
    hsdp: bool  # shard inside each host, replicate across hosts
    why: str  # for the one line the chief prints


def choose_layout(shard_within: str, *, hosts: int, world: int, parameters: int, rank_memory_bytes: float) -> Layout:
    """What ``--shard-within`` means for this job (``rank_memory_bytes``: the least any rank has)."""
    if shard_within == "all" or hosts < 2:
        return Layout(False, "" if shard_within == "all" else "auto: one host")
    if world % hosts:
        if shard_within == "host":
            raise ConfigError(f"--shard-within host: {world} ranks do not split evenly over {hosts} hosts")
        return Layout(False, f"auto: {world} ranks do not split evenly over {hosts} hosts")
    if shard_within == "host":
        return Layout(True, "")
    per_rank = BYTES_PER_PARAMETER * parameters / (world // hosts)
    budget = _STATE_SHARE * rank_memory_bytes
    verdict = "fits" if per_rank <= budget else "does not fit"
    return Layout(per_rank <= budget, f"auto: {per_rank / 2**30:.2f} GiB of model state per rank sharded inside a "
                                      f"host {verdict} in half of {rank_memory_bytes / 2**30:.1f} GiB")
