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
        libc.malloc_trim(0)  # the heap's free top given back: a block can only come from growing it
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


def test_the_cost_model_charges_from_the_threshold_sharded_fixes() -> None:
    from distrun.planner.cost import MAPPED_AFRESH_FROM_BYTES
    from distrun.strategies.sharding.allocator import MMAP_THRESHOLD_BYTES

    assert MAPPED_AFRESH_FROM_BYTES == MMAP_THRESHOLD_BYTES


def test_the_probes_sharded_step_runs_under_shardeds_allocator_on_cpu() -> None:
    assert _run(_FROM_HEAP + _SHARDED_STEP + "print(from_heap())") == "False"


_LAST = textwrap.dedent("""
    import os, sys, tempfile, types
    import torch, torch.distributed as dist
    from torch import nn
    from torch.utils.data import TensorDataset
    import distrun.planner.overheads as overheads
    from distrun.runtime._probe_recipe import measure_recipe
    fixed = []
    real_fix = overheads.fix_mmap_threshold
    overheads.fix_mmap_threshold = lambda: fixed.append(1) or real_fix()
    rank, store = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    recipe = types.ModuleType("recipe")
    recipe.model = lambda: nn.Sequential(*(nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(2)))
    recipe.optimizer = lambda params: torch.optim.SGD(params, lr=0.1)
    recipe.loss = lambda out, batch: out.square().mean()
    recipe.train_data = lambda ctx: TensorDataset(torch.randn(64, 512))
    figures, last = measure_recipe(recipe, {"global_batch_size": 8, "rows": 4}, rank, 2, torch.device("cpu"))
    before = len(fixed)  # the overheads and the links were timed under the process's own allocator
    whole = last()
    print(before, len(fixed), whole["profile"]["sharded_step_s"] > 0, whole is figures)
    dist.destroy_process_group()
""")


def test_the_probe_times_sharded_last_so_the_other_layouts_figures_keep_the_processs_allocator(tmp_path) -> None:
    """The probe's other figures (DDP's, a pipeline's and FSDP2's fixed costs, the collectives'
    rates) are the mirrored and pipelined ranks', which never fix the threshold: they are timed
    first, and the sharded step, which fixes it, last. (What malloc does cannot tell here: a heap
    the probe has grown serves a block from its free space whatever the threshold, so the calls
    to the setting are counted.)"""
    script = tmp_path / "probe.py"
    script.write_text(_LAST)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), store], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=180) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
        assert out.split() == ["0", "1", "True", "True"], out
