"""Live training table and final summary: pure functions of snapshots."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from distrun.protocol import JobSnapshot, JobSummary, ReplicaRow, ReplicaStatus, describe_mesh, mesh_place
from distrun.ui._format import fmt_loss, fmt_rate, fmt_seconds

_STATUS_STYLE = {
    ReplicaStatus.STARTING: "dim",
    ReplicaStatus.RUNNING: "green",
    ReplicaStatus.DONE: "cyan",
    ReplicaStatus.FAILED: "bold red",
    ReplicaStatus.STOPPED: "yellow",
}


def render_progress(snapshot: JobSnapshot) -> RenderableType:
    if snapshot.ps_tasks:
        tables: list[RenderableType] = [_worker_table(snapshot), _ps_table(snapshot)]
    else:
        tables = [_replica_table(snapshot)]
    total = snapshot.total_steps
    bar = ProgressBar(total=float(total) if total else None, completed=float(snapshot.step), width=40)
    line = Text.assemble(
        f" step {snapshot.step}/{total if total else '?'}",
        f"  {fmt_rate(snapshot.samples_per_s)} samples/s now",  # the summary's is the mean after step 1
        f"  {fmt_rate(snapshot.tokens_per_s)} tokens/s" if snapshot.tokens_per_s is not None else "",
        f"  MFU {snapshot.mfu:.1%}" if snapshot.mfu is not None else "",
        f"  lr {snapshot.lr:.3g}" if snapshot.lr is not None else "",
        f"  elapsed {fmt_seconds(snapshot.elapsed_s)}",
        f"  ETA {fmt_seconds(snapshot.eta_s)}",
    )
    parts: list[RenderableType] = [*tables, Group(bar, line)]
    if snapshot.evaluator_step is not None:
        parts.append(Text(f"evaluator (checkpoint of step {snapshot.evaluator_step}): "
                          + "  ".join(f"{k}={v:.4g}" for k, v in snapshot.evaluator_metrics.items())))
    if snapshot.compile_line:
        parts.append(Text(snapshot.compile_line, style="yellow" if "0 graph break" not in snapshot.compile_line else ""))
    if snapshot.membership_line:
        parts.append(Text(snapshot.membership_line, style="yellow"))
    if snapshot.sync_line:
        parts.append(Text(snapshot.sync_line))
    if snapshot.straggler_line:
        parts.append(Text(snapshot.straggler_line, style="yellow"))
    if snapshot.hang:
        parts.append(Text(f"hang: {snapshot.hang}", style="bold red"))
    if snapshot.eval_metrics:
        parts.append(Text("eval: " + "  ".join(f"{k}={v:.4g}" for k, v in snapshot.eval_metrics.items())))
    return Group(*parts)


#: Figures a user reads whole at 80 columns (a loss of 0.01355, a step): the other columns give way.
_WHOLE = ("rank", "place", "step", "loss", "samples/s", "status")


def _columns(table: Table, names: tuple[str, ...], hosts: bool, host_width: int = 0) -> None:
    """Host names and the figures in ``_WHOLE`` are never cut: the other columns give way."""
    for column in names:
        if column == "host" and not hosts:
            continue
        if column == "host":
            table.add_column(column, no_wrap=True, min_width=host_width)
            continue
        table.add_column(column, justify="left" if column in ("device", "status") else "right", overflow="ellipsis",
                         no_wrap=column in _WHOLE)


def _host_width(snapshot: JobSnapshot) -> int:
    return max((len(row.host or "") for row in snapshot.rows), default=0)


def _worker_table(snapshot: JobSnapshot) -> Table:
    """parameter-server workers: each trains at its own pace; staleness is how far behind its gradients land."""
    table = Table(title=f"{snapshot.recipe} · {snapshot.strategy} · workers", title_justify="left")
    hosts = any(row.host for row in snapshot.rows)
    _columns(table, ("host", "rank", "step", "steps/s", "staleness", "loss", "samples/s", "seen", "status"), hosts,
             _host_width(snapshot))
    for row in snapshot.workers:
        _add_row(table, row, hosts,
                 str(row.step),
                 "-" if row.steps_per_s is None else f"{row.steps_per_s:.1f}",
                 "-" if row.staleness is None else str(row.staleness),
                 fmt_loss(row.loss),
                 fmt_rate(row.samples_per_s))
    return table


def _ps_table(snapshot: JobSnapshot) -> Table:
    table = Table(title="ps tasks", title_justify="left")
    hosts = any(row.host for row in snapshot.rows)
    _columns(table, ("host", "rank", "updates", "updates/s", "MB in", "MB out", "params", "seen", "status"), hosts,
             _host_width(snapshot))
    for row in snapshot.ps_tasks:
        _add_row(table, row, hosts,
                 str(row.updates),
                 f"{row.updates_per_s:.1f}",
                 f"{row.bytes_in / 2**20:.1f}",
                 f"{row.bytes_out / 2**20:.1f}",
                 f"{row.params:,}")
    return table


def _add_row(table: Table, row: ReplicaRow, hosts: bool, *cells: RenderableType) -> None:
    """host (on a cluster), rank, the table's own cells, then seen and status: every table's frame."""
    status = (Text(f"slow {row.slow:.2f}x", style="bold yellow") if row.slow is not None
              and row.status is ReplicaStatus.RUNNING else Text(row.status.value, style=_STATUS_STYLE[row.status]))
    table.add_row(*((row.host or "-",) if hosts else ()), str(row.rank), *cells, fmt_seconds(row.last_seen_s), status)


def _replica_table(snapshot: JobSnapshot) -> Table:
    """One row per rank; under --tp the title shows the mesh and a column each rank's place in it."""
    mesh = snapshot.mesh
    title = f"{snapshot.recipe} · {snapshot.strategy}" + (f" · {describe_mesh(mesh)}" if mesh else "")
    if snapshot.micro_batch:  # --accumulate
        title += f" · micro-batch {snapshot.micro_batch[0]} × {snapshot.micro_batch[1]}"
    table = Table(title=title, title_justify="left", expand=False)
    hosts = any(row.host for row in snapshot.rows)
    gpu = any(row.gpu_util is not None for row in snapshot.rows)  # NVML figures: a GPU % column
    names = ("host", "rank", *(("place",) if mesh else ()), "device", "step", "loss", "samples/s",
             *(("GPU %",) if gpu else ()), "mem MB", "peak MB", "seen", "status")
    _columns(table, names, hosts, _host_width(snapshot))
    for row in snapshot.rows:
        util = (("-" if row.gpu_util is None else f"{row.gpu_util:.0f}"),) if gpu else ()
        place = (" ".join(f"{k}{v}" for k, v in mesh_place(row.rank, mesh).items()),) if mesh else ()
        _add_row(table, row, hosts, *place, row.device, str(row.step), fmt_loss(row.loss),
                 fmt_rate(row.samples_per_s), *util, f"{row.mem_mb:.0f}",
                 f"{row.peak_mem_mb:.0f}" if row.peak_mem_mb else "-")
    return table


def render_summary(summary: JobSummary) -> RenderableType:
    table = Table(title="summary", title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    style = "green" if summary.status == "succeeded" else "red"
    table.add_row("status", Text(summary.status, style=style)
                  + (Text(f" ({summary.reason})") if summary.reason else Text("")))
    if summary.recipe_kind == "script":  # its own DDP: the strategy only chose how many processes
        table.add_row("strategy", f"script ({summary.replicas} processes)")
    elif summary.mesh:  # a replica of several ranks
        ranks = summary.mesh.get("dp", 1) * summary.mesh.get("tp", 1) * summary.mesh.get("pp", 1)
        table.add_row("strategy", f"{summary.strategy} × {summary.replicas} ({describe_mesh(summary.mesh)}, "
                                  f"{ranks} ranks)")
    else:
        table.add_row("strategy", f"{summary.strategy} × {summary.replicas}")
    table.add_row("steps", str(summary.steps))
    if summary.micro_batch_size is not None:
        table.add_row("micro-batch", f"{summary.micro_batch_size} samples a replica, {summary.accumulate} a step "
                                     "(--accumulate)")
    if summary.outer_steps is not None:  # diloco: --steps counts inner steps
        table.add_row("outer steps", f"{summary.outer_steps} ({summary.sync_mb:.2f} MB sent by rank 0, "
                                     f"{summary.sync_blocked_s:.2f} s waited)")
    if summary.embedding_bytes_per_step is not None:  # --embeddings ps
        table.add_row("bytes a step", f"{summary.embedding_bytes_per_step:,.0f} B of embedding rows pulled and "
                                      f"pushed, {summary.dense_grad_bytes_per_step or 0:,.0f} B of dense gradients "
                                      "all-reduced (each replica)")
    table.add_row("final loss", fmt_loss(summary.final_loss))
    table.add_row("samples/s (mean)", fmt_rate(summary.samples_per_s) + " from the end of step 1 to the last"
                  + (", evaluations left out" if summary.recipe_kind == "fit" else ""))
    if summary.tokens_per_s is not None:
        table.add_row("tokens/s", fmt_rate(summary.tokens_per_s)
                      + (f" (MFU {summary.mfu:.1%})" if summary.mfu is not None else ""))
    if summary.peak_mem_mb:
        peaks = summary.peak_mem_mb
        table.add_row("peak memory", ", ".join(f"rank {rank} {mb:.0f} MB" for rank, mb in list(peaks.items())[:8])
                      + (f", ... (max {max(peaks.values()):.0f} MB)" if len(peaks) > 8 else ""))
    start = "warm (forked from a warm interpreter)" if summary.warm else "cold (fresh interpreters)"
    table.add_row("time to first step", f"{fmt_seconds(summary.time_to_first_step_s)}, {start}")
    if summary.precision != "fp32":
        table.add_row("precision", summary.precision)
    if summary.compression != "none":
        table.add_row("compression", summary.compression)
    if summary.allreduce != "flat" or summary.allreduce_reason:
        why = f" (auto: {summary.allreduce_reason})" if summary.allreduce_reason else ""
        table.add_row("all-reduce", summary.allreduce + why)
    if summary.compile is not None:
        figures = summary.compile
        table.add_row("compile", f"{figures['mode']}: {fmt_seconds(figures['compile_s'])} compiling, "
                                 f"{figures['graphs']} graph(s), {figures['graph_breaks']} break(s), "
                                 f"{figures['recompiles']} recompilation(s)")
    table.add_row("wall time", fmt_seconds(summary.wall_s))
    if summary.restarts:
        table.add_row("restarts", str(summary.restarts))
    if summary.membership_changes:
        table.add_row("membership", f"{summary.membership_changes} change(s), now {summary.world_size} replica(s); "
                                    f"{summary.steps_lost} step(s) lost; longest recovery "
                                    f"{fmt_seconds(summary.recovery_s)}")
    if summary.ranks_lost:
        table.add_row("ranks lost", ", ".join(map(str, summary.ranks_lost)) + " (past their restarts; the job went on)")
    for key, value in summary.eval_metrics.items():
        table.add_row(f"eval {key}", f"{value:.4g}")
    if summary.evaluator_step is not None:
        for key, value in summary.evaluator_metrics.items():
            table.add_row(f"evaluator {key}", f"{value:.4g} (step {summary.evaluator_step})")
    if summary.stragglers:
        table.add_row("stragglers", ", ".join(f"rank {rank} up to {ratio:.2f}x the others' compute time"
                                               for rank, ratio in summary.stragglers.items()))
    if summary.profile_dir:
        table.add_row("profile", f"{summary.profile_traces} trace(s) in {summary.profile_dir}")
    if summary.resumed:
        done = "; already at or past the last step: nothing trained" if summary.resumed["past_end"] else ""
        table.add_row("resumed", f"step {summary.resumed['step']} from {summary.resumed['path']}{done}")
    if summary.last_checkpoint:
        waited = (f" (a step waited at most {summary.checkpoint_blocked_ms:.0f} ms)"
                  if summary.checkpoint_blocked_ms is not None else "")
        table.add_row("checkpoint", summary.last_checkpoint + waited)
    return table
