"""`--allreduce auto`'s rules and its probe's decision (the probe on real hosts: tests/cluster)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distrun.strategies.communication.allreduce_auto import MIN_GAIN, PROBE_MAX_BYTES, known_choice, probe, probe_sizes
from tests._sshd import free_port


@pytest.mark.parametrize(("nodes", "backend", "powersgd", "expected"), [
    ([0, 0, 1, 1], "nccl", False, "NCCL chooses its own"),
    ([0, 0, 1, 1], "gloo", True, "PowerSGD runs its own"),
    ([0, 0, 0], "gloo", False, "one host"),
    ([0, 1, 2], "gloo", False, "one rank on each of 3 hosts"),
])
def test_known_choices_are_flat_and_say_why(nodes, backend, powersgd, expected):
    choice = known_choice(nodes, backend=backend, powersgd=powersgd)
    assert choice is not None and choice.algorithm == "flat" and expected in choice.reason
    assert choice.flat_ms is None


def test_two_hosts_with_two_ranks_each_must_be_measured():
    assert known_choice([0, 0, 1, 1], backend="gloo", powersgd=False) is None
    assert known_choice([0, 1, 0, 1], backend="gloo", powersgd=False) is None


def test_probe_sizes_follow_ddp_buckets_up_to_the_cap():
    mb = 2**20
    assert probe_sizes([1 * mb, 2 * mb]) == [1 * mb, 2 * mb]
    assert probe_sizes([25 * mb, 25 * mb]) == [PROBE_MAX_BYTES]  # the first bucket, cut
    assert probe_sizes([3 * mb, 3 * mb, 3 * mb], cap_bytes=8 * mb) == [3 * mb, 3 * mb, 2 * mb]
    assert probe_sizes([]) == [mb]


@pytest.fixture(scope="module")
def group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Clock:
    """The probe's clock: its seconds pass only as the stand-in all-reduces say, so the times the
    probe compares are exact on any host (a loaded one stretched the sleeps it used before)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def all_reduce_taking(self, seconds_per_mb: float):
        def run(buffer: torch.Tensor) -> None:
            self.now_s += seconds_per_mb * buffer.numel() * buffer.element_size() / 2**20
        return run


@pytest.mark.parametrize(("flat_s", "hier_s", "expected"), [
    (0.010, 0.005, "hierarchical"),
    (0.005, 0.010, "flat"),
    (0.010, 0.010 * (1 - MIN_GAIN / 4), "flat"),  # too close to leave DDP's own path
    (0.010, 0.010 * (1 - 2 * MIN_GAIN), "hierarchical"),  # past the margin
])
def test_the_probe_keeps_the_faster_and_reports_both(group, flat_s, hier_s, expected):
    clock = _Clock()
    choice = probe([2**20, 2**20], flat=clock.all_reduce_taking(flat_s), hierarchical=clock.all_reduce_taking(hier_s),
                   dtype=torch.float32, device=torch.device("cpu"), hosts=2, slots=2, clock_s=clock)
    assert choice.algorithm == expected
    assert choice.flat_ms == pytest.approx(2 * flat_s * 1e3)  # two 1 MB buckets a pass
    assert choice.hierarchical_ms == pytest.approx(2 * hier_s * 1e3)
    assert "2 bucket(s), 2.0 MB, 2 hosts x 2 ranks" in choice.reason
