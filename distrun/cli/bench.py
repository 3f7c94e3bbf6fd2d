"""`distrun bench WORKLOAD`: benchmarks that print ratios against the alternative.

Workloads: ``overhead`` (distrun against torchrun + DDP), ``ttfs`` (time to
first step, cold and warm, here or on a cluster), ``memory`` (each rank's bytes under
mirrored and sharded), and the scaling report ``resnet50`` /
``resnet18`` / ``mlp`` (images/s and scaling efficiency, docs/benchmarks.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from distrun.bench.allreduce import DEFAULT_SIZES_MB, run_allreduce
from distrun.bench.compression import run_compression
from distrun.bench.embeddings import render_embeddings, run_embeddings
from distrun.bench.auto import run_auto
from distrun.bench.layouts import run_layouts
from distrun.bench.pipeline import run_pipeline
from distrun.bench.slowlinks import run_slowlinks
from distrun.bench.elastic import run_elastic
from distrun.bench.memory import run_memory
from distrun.bench.overhead import run_overhead
from distrun.bench.scaling import replica_counts, run_scaling
from distrun.bench.straggler import run_straggler
from distrun.bench.ttfs import run_local_ttfs, run_ttfs
from distrun.cli._app import app, stderr
from distrun.cli.cluster import resolve_cluster
from distrun.cli._spec import local_layout
from distrun.config import Role
from distrun.config.job import PRECISIONS
from distrun.errors import Interrupted, UsageError
from distrun.launch import visible_gpu_count
from distrun.ui.bench import render_auto, render_allreduce, render_compression, render_elastic, render_layouts, render_memory, render_overhead, render_pipeline, render_scaling, render_slowlinks, render_straggler, render_ttfs

_SCALING = ("resnet50", "resnet18", "mlp")


@app.command()
def bench(
    workload: str = typer.Argument(..., help="overhead | ttfs | straggler | allreduce | compression | elastic | memory | pipeline | layouts | embeddings | auto | slowlinks | resnet50 | resnet18 | mlp"),
    cluster_file: Path | None = typer.Option(None, "--cluster", help="ttfs, scaling, allreduce, compression, elastic, pipeline, slowlinks, auto: the (running) cluster to measure (none: this machine).", rich_help_panel="Where"),
    replicas: int | None = typer.Option(None, "--replicas", "-n", help="overhead: processes (2); scaling on CPU, memory: up to N (2; memory 4); straggler: workers (3); local ttfs: ranks (one per GPU, else 2).", rich_help_panel="Where"),
    gpus: int | None = typer.Option(None, "--gpus", help="scaling: 1, 2, 4, ... N GPUs (one process each, NCCL).", rich_help_panel="Where"),
    device: str = typer.Option("auto", "--device", help="scaling, local ttfs: auto | cpu | cuda", rich_help_panel="Where"),
    steps: int | None = typer.Option(None, "--steps", help="overhead: training steps (200); memory, layouts: steps (3); embeddings: steps (20); auto: steps (5); scaling, compression: timed steps (20); pipeline: steps (10); slowlinks: steps (100); elastic: steps (60, a rank lost halfway).", rich_help_panel="Steps and repeats"),
    warmup: int = typer.Option(5, "--warmup", help="scaling: untimed steps first.", rich_help_panel="Steps and repeats"),
    image_size: int = typer.Option(224, "--image-size", help="scaling: image height and width.", rich_help_panel="Workload: resnet50, resnet18, mlp (scaling)"),
    batch: int = typer.Option(128, "--batch", help="scaling: images per replica per step.", rich_help_panel="Workload: resnet50, resnet18, mlp (scaling)"),
    strategy: str = typer.Option("mirrored", "--strategy", "-s", help="scaling: the strategy for 2+ replicas.", rich_help_panel="Workload: resnet50, resnet18, mlp (scaling)"),
    precision: str | None = typer.Option(None, "--precision", help="scaling: fp32 | bf16 | fp16 (default bf16 on GPU, fp32 on CPU).", rich_help_panel="Workload: resnet50, resnet18, mlp (scaling)"),
    compile_model: bool = typer.Option(False, "--compile", help="scaling: torch.compile distrun's model and the --compare baseline.", rich_help_panel="Workload: resnet50, resnet18, mlp (scaling)"),
    compare: str | None = typer.Option(None, "--compare", help="scaling: `ddp` also runs torchrun + DDP of the same model.", rich_help_panel="Workload: resnet50, resnet18, mlp (scaling)"),
    table_rows: int = typer.Option(1_000_000, "--table-rows", help="embeddings: rows of the embedding table (x 32 dims).", rich_help_panel="Workload: embeddings"),
    sizes_mb: str = typer.Option(",".join(f"{s:g}" for s in DEFAULT_SIZES_MB), "--sizes-mb", help="allreduce: message sizes in MB (2^20 bytes), comma-separated.", rich_help_panel="Workload: allreduce"),
    global_batch_size: int = typer.Option(256, "--global-batch-size", "-b", help="overhead: samples per step.", rich_help_panel="Steps and repeats"),
    repeats: int = typer.Option(3, "--repeats", help="overhead, ttfs: runs per contender, the median reported; allreduce: timed operations per size.", rich_help_panel="Steps and repeats"),
    slow_factor: float = typer.Option(3.0, "--slow-factor", help="straggler: how many times slower the slow worker is.", rich_help_panel="Workload: straggler"),
    step_s: float = typer.Option(0.03, "--step-s", help="straggler: the other workers' step time (an injected sleep).", rich_help_panel="Workload: straggler"),
    target_loss: float = typer.Option(0.15, "--target-loss", help="straggler: report batches and seconds to this loss.", rich_help_panel="Workload: straggler"),
    plot: Path | None = typer.Option(None, "--plot", help="scaling, allreduce: draw the figures to FILE.png (matplotlib).", rich_help_panel="Output"),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table.", rich_help_panel="Output"),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks.", rich_help_panel="Output"),
) -> None:
    """Measure distrun against the alternative, in one run (docs/performance.md, docs/benchmarks.md)."""
    say = (lambda msg: None) if json_output else (lambda msg: stderr.print(f"[bench] {msg}", markup=False))
    try:
        if workload == "overhead":
            report = _overhead(replicas or 2, steps or 200, global_batch_size, repeats, say)
            _show(report, json_output, render_overhead)
        elif workload == "ttfs":
            _positive(repeats=repeats)
            if cluster_file is not None:
                report = run_ttfs(cluster=cluster_file, repeats=repeats, progress=say)
            else:
                ttfs_device, ttfs_replicas = _local_ttfs_layout(device, replicas)
                report = run_local_ttfs(replicas=ttfs_replicas, device=ttfs_device, repeats=repeats, progress=say)
            _show(report.to_dict(), json_output, render_ttfs)
        elif workload == "straggler":
            workers = replicas or 3
            _positive(replicas=workers, steps=steps or 600)
            if workers < 2 or slow_factor <= 1 or step_s <= 0:
                raise UsageError("bench straggler: needs --replicas 2 or more, --slow-factor above 1 and a positive "
                                 f"--step-s. Received: {workers}, {slow_factor:g}, {step_s:g}")
            report = run_straggler(workers=workers, slow_factor=slow_factor, step_s=step_s, steps=steps or 600,
                                   target_loss=target_loss, progress=say)
            _show(report.to_dict(), json_output, render_straggler)
        elif workload == "allreduce":
            report = _allreduce(cluster_file, sizes_mb, repeats, say)
            _show(report, json_output, render_allreduce)
            if plot is not None:
                _plot_allreduce(report, plot)
        elif workload == "compression":
            if cluster_file is None:
                raise UsageError("bench compression: needs --cluster FILE (a running cluster; compression pays "
                                 "between hosts)")
            _positive(steps=steps or 20)
            report = run_compression(cluster=cluster_file, steps=steps or 20, progress=say)
            _show(report, json_output, render_compression)
        elif workload == "elastic":
            if cluster_file is None:
                raise UsageError("bench elastic: needs --cluster FILE (a running cluster of two or more worker hosts)")
            _positive(steps=steps or 60)
            hosts = sum(1 for host in resolve_cluster(cluster_file).hosts if Role.WORKER in host.roles)
            report = run_elastic(cluster=cluster_file, hosts=hosts, steps=steps or 60, kill_at=(steps or 60) // 2,
                                 progress=say)
            _show(report, json_output, render_elastic)
        elif workload == "memory":
            most = replicas or 4
            _positive(replicas=most, steps=steps or 3)
            counts = tuple(n for n in (1, 2, 4, 8, 16, 32) if n < most) + (most,)
            report = run_memory(replica_counts=counts, steps=steps or 3, progress=say)
            _show(report, json_output, render_memory)
        elif workload == "pipeline":
            if cluster_file is None:
                raise UsageError("bench pipeline: needs --cluster FILE (a running cluster of two worker hosts of one "
                                 "slot each; pipeline stages pay across hosts)")
            _positive(steps=steps or 10)
            report = run_pipeline(cluster=cluster_file, steps=steps or 10, progress=say)
            _show(report, json_output, render_pipeline)
        elif workload == "slowlinks":
            if cluster_file is None:
                raise UsageError("bench slowlinks: needs --cluster FILE (a running cluster of two or more worker hosts "
                                 "joined by the links to measure)")
            _positive(steps=steps or 100)
            report = run_slowlinks(cluster=cluster_file, steps=steps or 100, eval_every=max(1, (steps or 100) // 10),
                                   progress=say)
            _show(report, json_output, render_slowlinks)
        elif workload == "auto":
            _positive(steps=steps or 5)
            report = run_auto(steps=steps or 5, cluster=cluster_file, progress=say)
            _show(report, json_output, render_auto)
        elif workload == "layouts":
            _positive(steps=steps or 3)
            report = run_layouts(steps=steps or 3, progress=say)
            _show(report, json_output, render_layouts)
        elif workload == "embeddings":
            _positive(steps=steps or 20, table_rows=table_rows)
            report = run_embeddings(rows=table_rows, steps=steps or 20, progress=say)
            _show(report, json_output, render_embeddings)
        elif workload in _SCALING:
            report = _scaling(workload, cluster_file, replicas, gpus, device, steps or 20, warmup, image_size, batch,
                              strategy, compare, json_output, precision, compile_model)
            _show(report, json_output, render_scaling)
            if plot is not None:
                _plot(report, plot)
        else:
            raise UsageError(f"bench: unknown workload {workload!r}; choose overhead, ttfs, straggler, allreduce, compression, elastic, memory, pipeline, layouts, embeddings, auto, slowlinks, "
                             f"{', '.join(_SCALING)}")
    except KeyboardInterrupt:  # the contenders share our process group and got the SIGINT too
        raise Interrupted("interrupted: benchmark stopped") from None


def _show(report: dict[str, Any], json_output: bool, render: Any) -> None:
    if json_output:
        typer.echo(json.dumps(report))
    else:
        Console(highlight=False).print(render(report))


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise UsageError(f"--{name.replace('_', '-')}: expected a positive whole number. Received: {value}")


def _local_ttfs_layout(device: str, replicas: int | None) -> tuple[str, int]:
    """(device, ranks) for the local ttfs: `distrun train`'s own defaults (one rank per GPU, else 2)."""
    device, ranks = local_layout(device, replicas, visible_gpu_count())
    _positive(replicas=ranks)
    return device, ranks


def _overhead(replicas: int, steps: int, global_batch_size: int, repeats: int, say: Any) -> dict[str, Any]:
    _positive(replicas=replicas, steps=steps, repeats=repeats, global_batch_size=global_batch_size)
    if steps < 2:
        raise UsageError("--steps: at least 2 (the first step is warm-up and not timed)")
    if global_batch_size % replicas:
        raise UsageError(f"--global-batch-size {global_batch_size} is not divisible by {replicas} replicas")
    return run_overhead(replicas=replicas, steps=steps, global_batch_size=global_batch_size, repeats=repeats,
                        progress=say).to_dict()


def _allreduce(cluster: Path | None, sizes_mb: str, repeats: int, say: Any) -> dict[str, Any]:
    if cluster is None:
        raise UsageError("bench allreduce: needs --cluster FILE (a running cluster of two or more worker hosts)")
    _positive(repeats=repeats)
    try:
        sizes = tuple(float(part) for part in sizes_mb.split(","))
    except ValueError:
        raise UsageError(f"--sizes-mb: expected sizes in MB separated by commas, e.g. 1,4,16. Received: {sizes_mb!r}") from None
    if not sizes or any(not 0 < size <= 4096 for size in sizes):
        raise UsageError(f"--sizes-mb: each size must be above 0 and at most 4096 MB. Received: {sizes_mb!r}")
    return run_allreduce(cluster=cluster, sizes_mb=sizes, repeats=repeats, progress=say)


def _scaling(model: str, cluster: Path | None, replicas: int | None, gpus: int | None, device: str, steps: int,
             warmup: int, image_size: int, batch: int, strategy: str, compare: str | None,
             json_output: bool, precision: str | None = None, compile_model: bool = False) -> dict[str, Any]:
    _positive(steps=steps, image_size=image_size, batch=batch)
    if precision is not None and precision not in PRECISIONS:
        raise UsageError(f"--precision: expected {', '.join(PRECISIONS)}. Received: {precision!r}")
    if compare not in (None, "ddp"):
        raise UsageError(f"--compare: only `ddp` is built. Received: {compare!r}")
    if cluster is not None and compare:
        raise UsageError("--compare ddp runs on this machine; it cannot be combined with --cluster")
    found = visible_gpu_count()
    if gpus is not None:
        _positive(gpus=gpus)
        if gpus > found:
            raise UsageError(f"--gpus {gpus}: found {found} GPU(s) on this machine (NVIDIA driver, "
                             "CUDA_VISIBLE_DEVICES); use --gpus {0} or --device cpu --replicas N".format(found or 1))
        if device == "cpu":
            raise UsageError("--gpus with --device cpu: choose one (--device cpu --replicas N runs CPU processes)")
        device, maximum = "cuda", gpus
    elif device == "cuda" or (device == "auto" and found and cluster is None):
        if not found:
            raise UsageError("--device cuda: no GPU found on this machine")
        device, maximum = "cuda", replicas or found
    else:
        device, maximum = "cpu", replicas or 2
    _positive(replicas=maximum)
    rows = 2 if cluster is not None else len(replica_counts(maximum))
    total = rows + (1 if compare else 0)
    with Progress(TextColumn("[bench] {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=stderr, transient=True, disable=json_output) as bar:
        task = bar.add_task("starting", total=total)
        started = [0]

        def step(message: str) -> None:
            """Each message starts the next run: the previous one is done."""
            bar.update(task, completed=started[0], description=message)
            started[0] += 1

        report = run_scaling(model=model, device=device, max_replicas=maximum, image_size=image_size, batch=batch,
                             steps=steps, warmup=warmup, strategy=strategy, cluster=cluster,
                             compare_ddp=compare == "ddp", precision=precision, compile_model=compile_model,
                             progress=step)
        bar.update(task, completed=total)
    return report.to_dict()


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'distrun[plot]'") from None
    return plt


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    replicas = [row["replicas"] for row in report["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(replicas, [row["images_per_s"] for row in report["rows"]], marker="o", label="distrun")
    left.plot(replicas, [row["replicas"] * report["rows"][0]["images_per_s"] for row in report["rows"]],
              linestyle="--", label="linear")
    left.set(xlabel="replicas", ylabel="images/s", title=f"{report['model']} throughput")
    left.legend()
    right.plot(replicas, [100 * row["scaling_efficiency"] for row in report["rows"]], marker="o")
    low, high = report["reference_efficiency"]
    right.axhspan(100 * low, 100 * high, alpha=0.2, label="seeds: 90-95%")
    right.set(xlabel="replicas", ylabel="scaling efficiency (%)", ylim=(0, 110), title="scaling efficiency")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)


def _plot_allreduce(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, axis = plt.subplots(figsize=(6, 4))
    for algorithm in ("flat", "hierarchical"):
        rows = [row for row in report["rows"] if row["algorithm"] == algorithm]
        axis.plot([row["size_mb"] for row in rows], [row["busbw_MBps"] for row in rows], marker="o", label=algorithm)
    if report.get("link_MBps_min"):
        axis.axhline(report["link_MBps_min"], linestyle="--", color="grey", label="slowest link (raw TCP)")
    axis.set(xscale="log", xlabel="message size (MB)", ylabel="busbw (MB/s)",
             title=f"all-reduce, {report['world_size']} ranks on {report['hosts']} hosts")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path)
