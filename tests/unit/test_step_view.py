"""The live view and summary for a replica's step settings: GPU figures, precision, compile."""

from rich.console import Console

from distrun.client._tracker import JobTracker
from distrun.protocol import Compiled, Done, Started, Step, Workload, decode_event, encode_event
from distrun.ui import render_progress, render_summary


def _text(renderable) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _step(rank: int, gpu_util: float | None) -> Step:
    return Step(rank=rank, time=1001.0, step=5, epoch=0, loss=0.5, samples_per_s=100.0, mem_mb=2048.0,
                total_steps=10, gpu_util=gpu_util)


def test_gpu_utilisation_gets_a_column_only_when_a_rank_reports_it():
    tracker = JobTracker("r.py", "mirrored", replicas=2, started_at=1000.0)
    for rank in range(2):
        tracker.update(Started(rank=rank, time=1000.0, pid=10 + rank, device=f"cuda:{rank}", world_size=2,
                               recipe_kind="fit"))
    tracker.update(_step(0, None))
    tracker.update(_step(1, None))
    assert "GPU %" not in _text(render_progress(tracker.snapshot()))  # torch's memory figure only
    tracker.update(decode_event(encode_event(_step(0, 87.0))))  # NVML figures survive the wire
    text = _text(render_progress(tracker.snapshot()))
    assert "GPU %" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if "cuda:" in line}
    assert " 87 " in rows["0"] and " - " in rows["1"]


def test_the_summary_carries_precision_and_the_chiefs_compile_figures():
    tracker = JobTracker("r.py", "mirrored", replicas=2, started_at=1000.0, precision="bf16", compile_mode="default")
    assert tracker.summary("succeeded").compile == {"mode": "default", "compile_s": None, "graphs": 0,
                                                    "graph_breaks": 0, "recompiles": 0}
    tracker.update(Compiled(rank=1, time=1002.0, graphs=9, graph_breaks=9, recompiles=9, compile_s=9.0))
    tracker.update(Compiled(rank=0, time=1002.0, graphs=2, graph_breaks=1, recompiles=1, compile_s=4.5,
                            reasons=("Failed to trace builtin operator print",)))
    tracker.update(Done(rank=0, time=1003.0, steps=10, final_loss=0.1, samples_per_s=50.0, first_step_time=1002.5))
    summary = tracker.summary("succeeded")
    assert summary.precision == "bf16"
    assert summary.compile == {"mode": "default", "compile_s": 4.5, "graphs": 2, "graph_breaks": 1, "recompiles": 1}
    assert summary.to_dict()["compile"]["graphs"] == 2
    assert "first break: Failed to trace builtin operator print" in tracker.snapshot().compile_line
    text = _text(render_summary(summary))
    assert "bf16" in text and "2 graph(s), 1 break(s), 1 recompilation(s)" in text


def test_without_compile_the_summary_says_null_and_fp32():
    summary = JobTracker("r.py", "one-device", replicas=1, started_at=0.0).summary("succeeded")
    assert summary.compile is None and summary.precision == "fp32"


def _narrow(renderable, width: int) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_host_names_are_never_cut_in_narrow_terminals():
    """Both tables once cut addresses to `198.18.0…`; the other columns give way instead."""
    from distrun.protocol.cluster import ClusterReport, HostRow, HostStatus
    from distrun.ui import render_cluster

    hosts = ["198.18.0.101:2222", "198.18.0.102:2222"]
    report = ClusterReport("lab", "status", tuple(HostRow(host, ("worker",), HostStatus.NOT_RUNNING) for host in hosts))
    tracker = JobTracker("recipe.py", "multi-worker", replicas=2, started_at=1000.0,
                         host_of_rank=lambda rank: hosts[rank].split(":")[0])
    for rank in range(2):
        tracker.update(Started(rank=rank, time=1000.0, pid=10 + rank, device="cpu", world_size=2, recipe_kind="fit"))
        tracker.update(_step(rank, None))
    for width in (60, 40):
        cluster_text = _narrow(render_cluster(report), width)
        progress_text = _narrow(render_progress(tracker.snapshot()), width)
        for host in hosts:
            assert host in cluster_text, cluster_text
            assert host.split(":")[0] in progress_text, progress_text


def test_tokens_per_s_and_mfu_come_from_samples_per_s_and_the_recipes_workload():
    """A GPU job of 2 ranks at 100 samples/s each, 256 tokens a sample, 1 GFLOP a token,
    on devices of 100 TFLOP/s: 51,200 tokens/s and 51.2 TFLOP/s of 200, so MFU 25.6%."""
    tracker = JobTracker("gpt.py", "sharded", replicas=2, started_at=1000.0)
    for rank in range(2):
        tracker.update(Started(rank=rank, time=1000.0, pid=10 + rank, device=f"cuda:{rank}", world_size=2,
                               recipe_kind="fit"))
        tracker.update(_step(rank, None))
    assert tracker.snapshot().tokens_per_s is None  # the recipe said nothing: samples/s only
    tracker.update(decode_event(encode_event(Workload(rank=0, time=1000.5, tokens_per_sample=256,
                                                      flops_per_token=1e9, peak_flops=100e12, devices=2))))
    snapshot = tracker.snapshot()
    assert snapshot.tokens_per_s == 51_200 and abs(snapshot.mfu - 0.256) < 1e-12
    assert "51.2k tokens/s" in _text(render_progress(snapshot)) and "MFU 25.6%" in _text(render_progress(snapshot))
    tracker.update(Done(rank=0, time=1003.0, steps=10, final_loss=0.1, samples_per_s=200.0, first_step_time=1002.5))
    summary = tracker.summary("succeeded")
    assert summary.tokens_per_s == 51_200 and abs(summary.mfu - 0.256) < 1e-12
    assert "51.2k (MFU 25.6%)" in _text(render_summary(summary))
    # Off a known GPU the workload has no peak: tokens/s, and no MFU made up.
    tracker.update(Workload(rank=0, time=1004.0, tokens_per_sample=256, flops_per_token=1e9, peak_flops=None))
    assert tracker.summary("succeeded").mfu is None


def test_at_80_columns_rank_step_loss_rate_and_status_are_whole():
    """They were cut to `0.01…` and `runn…` once a GPU % column came in; the other columns give way."""
    for host in (None, "198.18.0.11"):
        tracker = JobTracker("recipes/digits.py", "mirrored", replicas=2, started_at=1000.0,
                             host_of_rank=(lambda rank: host) if host else None)
        for rank in range(2):
            tracker.update(Started(rank=rank, time=1000.0, pid=10 + rank, device="cpu", world_size=2, recipe_kind="fit"))
            tracker.update(Step(rank=rank, time=1001.0, step=230, epoch=0, loss=0.01355, samples_per_s=6762.0,
                                mem_mb=399.0, peak_mem_mb=412.0, total_steps=230, gpu_util=50.0))
        text = _narrow(render_progress(tracker.snapshot()), 80)
        rows = [line for line in text.splitlines() if "230" in line and "│" in line]
        assert len(rows) == 2, text
        for rank, line in enumerate(rows):
            cells = [cell.strip() for cell in line.split("│")[1:-1]]
            assert [str(rank), "230", "0.01355", "6762.0", "running"] == [
                cell for cell in cells if cell in (str(rank), "230", "0.01355", "6762.0", "running")], text


def test_accumulation_names_the_micro_batch_in_the_live_view_and_the_summary():
    """--accumulate 2 at a global batch of 16 over 2 replicas: 4 samples a micro-batch, 2 a step."""
    tracker = JobTracker("r.py", "mirrored", replicas=2, started_at=1000.0, micro_batch=(4, 2))
    tracker.update(_step(0, None))
    assert "r.py · mirrored · micro-batch 4 × 2" in _text(render_progress(tracker.snapshot()))
    summary = tracker.summary("succeeded")
    assert (summary.micro_batch_size, summary.accumulate) == (4, 2)
    assert "4 samples a replica, 2 a step" in _text(render_summary(summary))
    plain = JobTracker("r.py", "mirrored", replicas=2, started_at=1000.0)
    plain.update(_step(0, None))
    assert "micro-batch" not in _text(render_progress(plain.snapshot()))
    assert "micro-batch" not in _text(render_summary(plain.summary("succeeded")))


def test_a_predict_jobs_bar_runs_to_the_largest_replicas_share():
    """`distrun predict` over 13 rows on 2 replicas at 2 rows a batch: rank 0 has 4 batches, rank 1 has
    3. The bar's total is the job's end (4), whichever rank reported last; a row has no loss."""
    tracker = JobTracker("r.py", "mirrored", replicas=2, started_at=1000.0)
    for rank, step, total in ((0, 2, 4), (1, 1, 3)):
        tracker.update(Step(rank=rank, time=1001.0, step=step, epoch=0, loss=None, samples_per_s=10.0, mem_mb=300.0,
                            total_steps=total))
    snapshot = tracker.snapshot()
    assert (snapshot.step, snapshot.total_steps) == (2, 4)
    text = _text(render_progress(snapshot))
    assert " step 2/4 " in text, text
    rows = {line.split("│")[1].strip(): line.split("│")[4].strip() for line in text.splitlines() if "│" in line}
    assert rows == {"0": "-", "1": "-"}, text  # the loss column
