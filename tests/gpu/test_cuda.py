"""The GPU path, run as a user would: the CPU tests' promises, checked on CUDA.

Each test runs the real CLI with ``--device cuda`` and compares against the same run on
the CPU, where tests/integration already pins the CPU behaviour. One GPU is enough; the
NCCL paths (2+ ranks) need a machine with two.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from distrun.strategies import latest_checkpoint
from tests.conftest import assert_no_processes, run_cli
from tests.integration._recipes import EQUIV, FP16_OVERFLOW, SLOW

pytestmark = pytest.mark.gpu

# 96 samples at global batch 16: six full batches an epoch, every step the same shapes.
FULL_BATCHES = ("--", "--samples", "96")
STEPS, LR = 12, 0.01
#: fp32 on two devices: the same arithmetic in a different order (cuBLAS vs MKL/oneDNN),
#: a few units of roundoff per step, carried through 12 Adam steps of size ~lr.
DEVICE_RTOL, DEVICE_ATOL = 1e-4, 1e-5


def train(recipe: Path, ckpt: Path, *args: str, env: dict[str, str] | None = None):
    result = run_cli("train", str(recipe), "--json", "--log-interval-s", "0", "--checkpoint-dir", str(ckpt), *args,
                     env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def checkpoint(ckpt: Path) -> dict:
    return torch.load(latest_checkpoint(ckpt), weights_only=True, map_location="cpu")


def losses(result) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in result.json_lines() if line["type"] == "step" and line["rank"] == 0}


def assert_same_params(a: dict, b: dict, what: str) -> None:
    assert set(a["model"]) == set(b["model"]), what
    for key, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][key], tensor, rtol=DEVICE_RTOL, atol=DEVICE_ATOL, msg=f"{what}: {key}")


def test_every_strategy_draws_the_cpu_batches_on_cuda(write_recipe, tmp_path):
    """Issue 11's first GPU run: step-1 loss 0.692892 on CPU, 0.684688 on CUDA."""
    recipe = write_recipe(EQUIV)
    cpu = train(recipe, tmp_path / "cpu", "--device", "cpu", "--steps", str(STEPS), *FULL_BATCHES)
    runs = {}
    for strategy in ("one-device", "mirrored", "central-storage"):
        result = train(recipe, tmp_path / strategy, "-s", strategy, "--replicas", "1", "--device", "cuda",
                       "--steps", str(STEPS), *FULL_BATCHES)
        started = [line for line in result.json_lines() if line["type"] == "started"]
        assert started and all(line["device"].startswith("cuda") for line in started), started
        runs[strategy] = result
        print(f"{strategy:16s} cuda step-1 loss {losses(result)[1]:.6f}  cpu {losses(cpu)[1]:.6f}")
    for strategy, result in runs.items():
        assert losses(result)[1] == pytest.approx(losses(cpu)[1], rel=1e-5), strategy
        assert_same_params(checkpoint(tmp_path / "cpu"), checkpoint(tmp_path / strategy), strategy)


@pytest.mark.parametrize(("first", "then"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_resumes_on_the_other_device_with_the_same_next_batch(write_recipe, tmp_path, first, then):
    recipe = write_recipe(EQUIV)
    straight = train(recipe, tmp_path / "straight", "--device", then, "--steps", str(STEPS), *FULL_BATCHES)
    train(recipe, tmp_path / "moved", "--device", first, "--steps", str(STEPS // 2), *FULL_BATCHES)
    resumed = train(recipe, tmp_path / "moved", "--device", then, "--steps", str(STEPS), "--resume", *FULL_BATCHES)
    assert checkpoint(tmp_path / "moved")["step"] == STEPS
    next_step = STEPS // 2 + 1
    assert losses(resumed)[next_step] == pytest.approx(losses(straight)[next_step], rel=1e-4)
    assert_same_params(checkpoint(tmp_path / "straight"), checkpoint(tmp_path / "moved"), f"{first} -> {then}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_on_cuda_stays_near_fp32(write_recipe, tmp_path, precision):
    """Bound as in tests/integration/test_precision.py: Adam moves each parameter by ~lr a
    step, and a rounding difference changes that move by at most the relative roundoff of
    the precision; after STEPS steps, at most STEPS * LR per parameter, and autocast must
    have changed something."""
    recipe = write_recipe(EQUIV)
    train(recipe, tmp_path / "fp32", "--device", "cuda", "--steps", str(STEPS), *FULL_BATCHES)
    result = train(recipe, tmp_path / precision, "--device", "cuda", "--precision", precision,
                   "--steps", str(STEPS), *FULL_BATCHES)
    assert result.summary["precision"] == precision
    fp32, ours = checkpoint(tmp_path / "fp32"), checkpoint(tmp_path / precision)
    diff = max((fp32["model"][k] - ours["model"][k]).abs().max().item() for k in fp32["model"])
    print(f"{precision}: max |param - fp32 param| after {STEPS} steps = {diff:.2e}")
    assert 0 < diff <= STEPS * LR
    if precision == "fp16":
        assert ours["scaler"]["scale"] == 2.0**16 and ours["scaler"]["_growth_tracker"] == STEPS


def test_an_fp16_overflow_on_cuda_skips_the_step_and_halves_the_scale(write_recipe, tmp_path):
    recipe = write_recipe(FP16_OVERFLOW)
    result = train(recipe, tmp_path / "ckpt", "--device", "cuda", "--precision", "fp16", "--steps", "6",
                   "--", "--samples", "96", "--overflow-at", "3", "--overflow-rank", "0")
    skips = [line["step"] for line in result.json_lines()
             if line["type"] == "log" and "fp16_skipped_step" in line["scalars"]]
    assert skips == [3]
    scaler = checkpoint(tmp_path / "ckpt")["scaler"]
    assert scaler["scale"] == 2.0**15 and scaler["_growth_tracker"] == 3


def test_compile_on_cuda_matches_eager_and_reuses_its_cache(write_recipe, tmp_path):
    recipe = write_recipe(EQUIV)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    train(recipe, tmp_path / "eager", "--device", "cuda", "--steps", str(STEPS), *FULL_BATCHES)
    times = []
    for run in ("first", "second"):
        result = train(recipe, tmp_path / run, "--device", "cuda", "--compile", "--steps", str(STEPS),
                       *FULL_BATCHES, env=env)
        summary = result.summary["compile"]
        assert summary["graphs"] >= 1 and summary["graph_breaks"] == 0 and summary["recompiles"] == 0, summary
        times.append((summary["compile_s"], result.summary["time_to_first_step_s"]))
        assert_same_params(checkpoint(tmp_path / "eager"), checkpoint(tmp_path / run), f"compiled ({run})")
    print(f"compile_s / time to first step: first run {times[0]}, second run (warm Inductor cache) {times[1]}")
    assert any((tmp_path / "inductor").rglob("*")), "nothing was written to the Inductor cache"


def test_the_live_view_reports_gpu_utilisation_and_memory(write_recipe, tmp_path):
    recipe = write_recipe(SLOW)
    result = train(recipe, tmp_path / "ckpt", "--device", "cuda", "--steps", "40")
    steps = [line for line in result.json_lines() if line["type"] == "step"]
    assert steps
    print("last step event:", json.dumps(steps[-1]))
    assert all(line["gpu_util"] is not None and 0 <= line["gpu_util"] <= 100 for line in steps), steps[-1]
    assert all(line["mem_mb"] > 0 for line in steps)


def test_a_warm_cuda_run_matches_a_cold_one_and_down_leaves_nothing(write_recipe, tmp_path):
    """The warm interpreter must not have touched CUDA: a forked child of a process that
    initialised it cannot use the GPU."""
    recipe = write_recipe(EQUIV)
    env = {"DISTRUN_HOME": str(tmp_path / "home")}
    assert run_cli("up", "--json", env=env).returncode == 0
    try:
        deadline = time.monotonic() + 90
        while True:
            status = run_cli("status", "--json", env=env)
            server = json.loads(status.stdout)["hosts"][0]["server"] if status.returncode == 0 else None
            if server and server["warm"]:
                break
            assert time.monotonic() < deadline, status.stderr
            time.sleep(0.3)
        cold = train(recipe, tmp_path / "cold", "--device", "cuda", "--cold", "--steps", str(STEPS),
                     *FULL_BATCHES, env=env)
        warm = train(recipe, tmp_path / "warm", "--device", "cuda", "--steps", str(STEPS), *FULL_BATCHES, env=env)
        assert cold.summary["warm"] is False and warm.summary["warm"] is True
        print(f"time to first step on cuda: cold {cold.summary['time_to_first_step_s']:.2f} s, "
              f"warm {warm.summary['time_to_first_step_s']:.2f} s")
        a, b = checkpoint(tmp_path / "cold"), checkpoint(tmp_path / "warm")
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    finally:
        assert run_cli("down", env=env).returncode == 0
    assert_no_processes(str(tmp_path))


@pytest.mark.parametrize("bench", [
    ("overhead", "--replicas", "8", "--steps", "20", "--repeats", "1"),
    ("straggler", "--steps", "60"),
])
def test_the_cpu_benchmarks_run_on_a_gpu_machine(bench):
    """Issue 11: `bench overhead --replicas 8` failed with `only 1 GPU(s) found`."""
    result = run_cli("bench", *bench, "--json", timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    print(bench[0], result.stdout.strip().splitlines()[-1][:600])


def test_a_profile_on_cuda_records_kernels_and_sends_compute_time(write_recipe, tmp_path):
    """--profile on a GPU rank adds CUDA activities (kernels on a stream); every step event past
    the first carries a compute time, timed with CUDA events (docs/debugging.md#slow-ranks)."""
    result = train(write_recipe(EQUIV), tmp_path, "--device", "cuda", "--replicas", "1", "--steps", "6",
                   "--profile", "2:3", *FULL_BATCHES)
    trace = next((tmp_path / "profile").glob("rank0.*.pt.trace.json"))
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(event.get("cat") == "kernel" for event in events)  # CUDA kernels, not only CPU ops
    # Each step once on the CPU (user_annotation); torch 2.11's CUDA traces repeat it on the GPU's
    # timeline (gpu_user_annotation), so the names are compared as a set.
    assert sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}) == [
        "ProfilerStep#2", "ProfilerStep#3"]
    steps = [line for line in result.json_lines() if line["type"] == "step" and line["step"] > 1]
    assert steps and all(line["compute_ms"] is not None for line in steps)  # on CUDA before: None
    print("cuda step_ms/compute_ms", [(line["step_ms"], line["compute_ms"]) for line in steps])


class Stall:
    """The current stream made to wait on a side stream's sleep, as it waits for NCCL's stream in
    DDP's and FSDP's waits; the CPU passes at once. ``stalled_s()``: how long the sleeps ran."""

    def __init__(self) -> None:
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cycles_per_ms = self._calibrate()

    def __call__(self, milliseconds: float) -> None:
        current, side = torch.cuda.current_stream(), torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            start.record()
            torch.cuda._sleep(int(milliseconds * self.cycles_per_ms))
            end.record()
        current.wait_stream(side)
        self._spans.append((start, end))

    def stalled_s(self) -> float:
        torch.cuda.synchronize()
        stalled = sum(start.elapsed_time(end) for start, end in self._spans) / 1e3
        self._spans.clear()
        return stalled

    @staticmethod
    def _calibrate() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(50_000_000)  # the clocks up
        start.record()
        torch.cuda._sleep(100_000_000)
        end.record()
        end.synchronize()
        return 100_000_000 / start.elapsed_time(end)


def read_wait_s(clock) -> float:
    """What the step's end read and, once the GPU caught up, the rest."""
    at_step_end = clock.waited_s()
    torch.cuda.synchronize()
    return at_step_end + clock.waited_s()


def test_a_stream_stall_after_the_last_gradient_is_this_steps_wait_on_cuda():
    """DDP's wait on a GPU is the compute stream stalled behind the all-reduce's stream: CUDA events
    see it where the CPU's clock does not (the unit tests run the same logic on the host)."""
    from torch import nn

    from distrun.strategies.step.sync_clock import SyncClock

    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stall = Stall()
    clock = SyncClock()
    clock.watch(model, optimizer, torch.device("cuda", torch.cuda.current_device()))
    assert clock.measures
    for stalled_ms in (0.0, 0.0, 200.0):  # the first step after watch() is a warm-up, read as 0
        torch.cuda.synchronize()
        clock.begin()
        cpu_started = time.perf_counter()
        model(torch.randn(64, 256, device="cuda")).sum().backward()
        stall(stalled_ms)
        optimizer.step()
        optimizer.zero_grad()
        cpu_s = time.perf_counter() - cpu_started
        waited_s, stalled_s = read_wait_s(clock), stall.stalled_s()
        print(f"stalled {stalled_s * 1e3:.1f} ms: the events read {waited_s * 1e3:.1f} ms, "
              f"the CPU took {cpu_s * 1e3:.1f} ms")
        if stalled_ms:
            assert stalled_s > 0.15 and cpu_s < stalled_s / 2  # the CPU passed the stall: its clock could not see it
            assert stalled_s * 0.95 <= waited_s < stalled_s + 0.02
        else:
            assert waited_s < 0.02
    clock.close()


def test_an_fsdp_gathers_stream_stall_is_this_steps_wait_on_cuda(tmp_path):
    """FSDP2's all-gather on a GPU stalls the compute stream inside wait_for_unshard; one GPU has no
    peer to wait for, so the stall is made there on purpose. Two GPUs with NCCL stay unrun here."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from distrun.strategies.step.sync_clock import SyncClock, _fsdp_parts

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()
        fully_shard(model[0])
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        groups, _ = _fsdp_parts(model)
        stall = Stall()
        for group in groups:
            def stalled(method=group.wait_for_unshard):
                stall(50.0)
                return method()
            group.wait_for_unshard = stalled
        clock = SyncClock()
        clock.watch(model, optimizer, torch.device("cuda", torch.cuda.current_device()))
        assert clock.measures
        for _ in range(2):  # the first step after watch() is a warm-up; the second is read
            clock.begin()
            model(torch.randn(64, 256, device="cuda")).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            waited_s, stalled_s = read_wait_s(clock), stall.stalled_s()
        print(f"FSDP on cuda: {len(groups)} groups, stalled {stalled_s * 1e3:.1f} ms, "
              f"the events read {waited_s * 1e3:.1f} ms")
        assert stalled_s >= 0.05 * 2 * len(groups) * 0.9  # each group's gather waited for, in forward and backward
        assert stalled_s * 0.95 <= waited_s < stalled_s + 0.03
        clock.close()
    finally:
        dist.destroy_process_group()
