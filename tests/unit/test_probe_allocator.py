"""The planner's probe times sharded's step under the allocator setting sharded's CPU ranks run under.

Fixing glibc's mmap threshold (strategies/sharding/allocator.py) keeps a sharded rank's memory
flat and doubles its step on this project's machine (0.65 s against 1.29 s for 64 rows a rank of
the 17M-parameter MLP of ``bench auto``); a probe that timed the step without it read sharded's
training step a third to a half low, and the planner chose sharded where it was the slowest.

Which setting a process runs under is read from what malloc does: with glibc's dynamic threshold,
freeing a 2 MiB block that was mapped raises the threshold, so the next 2 MiB block comes from the
heap; with the threshold fixed at 1 MiB every such block is mapped afresh. Each check runs in a
fresh interpreter, whose allocator no earlier test has set.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

_FROM_HEAP = textwrap.dedent("""
    import ctypes
    def from_heap(size=2 << 20):
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.free(libc.malloc(size))  # mapped; under the dynamic threshold, its free raises the threshold
        block = libc.malloc(size)
        heap = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
        low, high = (int(end, 16) for end in heap[0].split("-")) if heap else (0, 0)
        libc.free(block)
        return low <= block < high
""")

_SHARDED_STEP = textwrap.dedent("""
    import os, tempfile
    import torch, torch.distributed as dist
    from torch import nn
    from distrun.planner.overheads import sharded_step_s
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1),
                            rank=0, world_size=1)
    units = [nn.Linear(64, 64) for _ in range(2)]
    model = nn.Sequential(*units)
    x = torch.randn(4, 64)
    def step(sharded, optimizer):
        optimizer.zero_grad(set_to_none=True)
        sharded(x).sum().backward()
        optimizer.step()
    seconds = sharded_step_s(model, tuple(units), lambda params: torch.optim.Adam(params), step)
    assert seconds > 0
    dist.destroy_process_group()
""")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_fresh_process_takes_a_freed_blocks_size_from_the_heap() -> None:
    """The reading below can tell the two settings apart: glibc's own, then the one sharded fixes."""
    assert _run(_FROM_HEAP + "print(from_heap())") == "True"
    fixed = "from distrun.strategies.sharding.allocator import fix_mmap_threshold\nassert fix_mmap_threshold()\n"
    assert _run(_FROM_HEAP + fixed + "print(from_heap())") == "False"


def test_the_probes_sharded_step_runs_under_shardeds_allocator_on_cpu() -> None:
    assert _run(_FROM_HEAP + _SHARDED_STEP + "print(from_heap())") == "False"
