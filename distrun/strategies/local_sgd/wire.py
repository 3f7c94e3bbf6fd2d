"""What a pseudo-gradient crosses the wire as at a DiLoCo sync (``--sync-dtype``), and what it cost.

Every replica holds one pseudo-gradient per tensor (global weights minus its own); a sync leaves
every replica holding their mean. Three encodings:

- ``fp32``: one all-reduce of the tensors flattened into one buffer.
- ``bf16``: the same in bfloat16 (half the bytes); what rounding this replica's values drops is
  kept and added to its next sync's values (error feedback). The rounding inside the bf16 sum
  itself is not fed back.
- ``int8``: a quarter of fp32's bytes. Int8 values with different scales cannot be summed, and
  gloo has no int16 to sum them in, so the mean is built as a reduce-scatter then an all-gather:
  1. every replica agrees on one scale per tensor (an all-reduce MAX of each tensor's largest
     magnitude: a few bytes), and rounds its values to int8 levels of that scale;
  2. ``all_to_all`` hands each replica one slice of every replica's levels, which it sums in int32
     (the wider type) and turns into the slice's mean;
  3. the slice's mean, in the same levels (N levels summed and divided by N fit int8 again), is
     rounded, and an all-gather gives every replica every slice, scaled back per tensor.
  Both roundings' errors are fed back: the first into this replica's next values, the second
  into the owner's next values for its slice (times the replica count, as the mean divides it).
  This is INTELLECT-1's scheme (int8 pseudo-gradients, ring reduce in a wider type) with
  torch's collectives; a quantised sync never silently falls back to fp32.

``bytes_sent`` is what this replica sends for one sync under a ring algorithm (the count the
``distrun bench slowlinks`` figures check against the hosts' interfaces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["SyncCost", "PseudoGradientWire", "WIRE_DTYPES"]

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
_LEVELS = 127  # int8's symmetric range


@dataclass(frozen=True)
class SyncCost:
    """One sync's traffic from this replica: bytes sent (ring count) and elements averaged."""

    bytes_sent: int
    elements: int


class PseudoGradientWire:
    """Averages lists of fp32 tensors over ``group`` as ``dtype`` says; one per job.

    ``key`` names a fixed list of tensors (a fragment): its rounding errors are kept per key, so
    each fragment's feedback goes back into that fragment's next sync.
    """

    def __init__(self, dtype: str, *, members: int, rank: int, group: object = None) -> None:
        self.dtype = dtype
        self.members = members
        self._rank = rank
        self._group = group
        self._residual: dict[int, torch.Tensor] = {}

    def regroup(self, *, members: int, rank: int) -> None:
        """``--elastic``: the default group changed size; each fragment's rounding error stays (it is
        this replica's own)."""
        self.members, self._rank = members, rank

    def mean(self, key: int, tensors: list[torch.Tensor], *,
             weight: float | None = None) -> tuple[list[torch.Tensor], SyncCost]:
        """The replicas' mean of each tensor (new tensors, fp32, on the tensors' device).

        ``weight`` (every replica passes one, or none does): 1 to count this replica, 0 to leave
        it out; the mean is over the weights' sum (``--elastic``: a member healed into a sync
        others owe has no pseudo-gradient of its own).
        """
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        n = flat.numel()
        if self.members == 1:
            return [t.clone().float() for t in tensors], SyncCost(0, n)
        if weight is not None:
            flat = flat * weight
        if self.dtype != "fp32":
            residual = self._residual.get(key)
            if residual is not None and weight != 0:
                flat = flat + residual
        if self.dtype == "int8":
            result, sent = self._int8_mean(key, flat, [t.numel() for t in tensors])
            if weight is not None:  # the int8 path sums levels, not weights: count the members apart
                counted = torch.tensor([weight], device=flat.device)
                dist.all_reduce(counted, group=self._group)
                result = result * self.members / counted.clamp(min=1)
        else:
            if weight is not None:  # the count rides along as one more element of the sum
                flat = torch.cat([flat, flat.new_tensor([weight])])
            wire = flat.to(WIRE_DTYPES[self.dtype])
            if self.dtype != "fp32":
                self._residual[key] = (flat - wire.float())[:n]
            dist.all_reduce(wire, group=self._group)
            summed = wire.float()
            result = summed[:n] / (summed[n].clamp(min=1) if weight is not None else self.members)
            sent = _ring_all_reduce_bytes(wire.numel() * wire.element_size(), self.members)
        return _split_like(result, tensors), SyncCost(sent, n)

    def _int8_mean(self, key: int, flat: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, int]:
        members, n = self.members, flat.numel()
        # 1. One scale per tensor, the same on every replica.
        peaks = torch.stack([part.abs().max() if part.numel() else part.new_zeros(())
                             for part in flat.split(sizes)])
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self._group)
        scales = torch.where(peaks > 0, peaks / _LEVELS, torch.ones_like(peaks))
        per_element = torch.repeat_interleave(scales, torch.tensor(sizes, device=flat.device))
        levels = torch.round(flat / per_element).clamp_(-_LEVELS, _LEVELS)
        residual = flat - levels * per_element
        # 2. Reduce-scatter: each replica sums its slice of everyone's levels in int32.
        slice_len = -(-n // members)
        padded = slice_len * members
        sendbuf = torch.zeros(padded, dtype=torch.int8, device=flat.device)
        sendbuf[:n] = levels.to(torch.int8)
        received = torch.empty_like(sendbuf)
        dist.all_to_all_single(received, sendbuf, group=self._group)
        summed = received.view(members, slice_len).to(torch.int32).sum(dim=0)
        # 3. The slice's mean in the same levels (the sum of N levels over N fits int8 again),
        #    rounded; everyone gathers every slice and scales it back per tensor.
        mean_levels = summed.float() / members
        owner_levels = torch.round(mean_levels).clamp_(-_LEVELS, _LEVELS)
        mine = slice(self._rank * slice_len, min((self._rank + 1) * slice_len, n))
        if mine.stop > mine.start:  # fed back through this replica's share of the next mean
            lost = (mean_levels - owner_levels)[: mine.stop - mine.start] * per_element[mine]
            residual[mine] += members * lost
        self._residual[key] = residual
        gathered = torch.empty(padded, dtype=torch.int8, device=flat.device)
        _all_gather(gathered, owner_levels.to(torch.int8), group=self._group)
        mean = gathered[:n].float() * per_element
        share = (members - 1) * slice_len  # all_to_all and all_gather: every slice but one's own, one byte each
        sent = 2 * share + 4 * len(sizes)  # plus the scales' all-reduce
        return mean, sent


#: torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; 2.6 has only the first.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _ring_all_reduce_bytes(payload: int, members: int) -> int:
    """What one member sends in a ring all-reduce of ``payload`` bytes: 2 (N-1)/N of it."""
    return 2 * (members - 1) * payload // members


def _split_like(flat: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    parts, offset = [], 0
    for t in tensors:
        parts.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return parts
