"""Benchmark tables (plain values in, rich renderable out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table


def render_overhead(report: Mapping[str, Any]) -> Table:
    table = Table(
        title=(f"overhead: {report['replicas']} replicas, {report['steps']} steps, "
               f"global batch {report['global_batch_size']}, median of {report['repeats']}"),
        title_justify="left",
    )
    for column in ("contender", "samples/s", "vs torchrun+ddp", "time to first step"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    rows: Sequence[Mapping[str, Any]] = report["rows"]
    for row in rows:
        table.add_row(row["name"], f"{row['samples_per_s']:.0f}", f"{row['vs_ddp']:.3f}x",
                      f"{row['time_to_first_step_s']:.2f}s")
    return table


def render_ttfs(report: Mapping[str, Any]) -> Table:
    where = report.get("where", "cluster")
    table = Table(title=(f"time to first step ({where}): {report['world_size']} ranks, median of {report['repeats']}"),
                  title_justify="left")
    for column in ("contender", "time to first step", "vs cold torchrun", "wall (1-step job)", "vs cold torchrun "):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for row in report["rows"]:
        table.add_row(row["name"], f"{row['time_to_first_step_s']:.2f}s", f"{row['speedup_vs_torchrun']:.2f}x",
                      f"{row['wall_s']:.2f}s", f"{row['wall_speedup_vs_torchrun']:.2f}x")
    return table


def render_scaling(report: Mapping[str, Any]) -> Table:
    low, high = report["reference_efficiency"]
    title = (f"{report['model']} ({report['parameters']:,} parameters) on {report['device']}: image "
             f"{report['image_size']}, batch {report['batch_per_replica']} per replica, {report['steps']} timed steps, "
             f"{report.get('precision', 'fp32')}{', compiled' if report.get('compile') else ''}")
    caption = f"reference: the seeds' ResNet-50 on 1-8 V100s scaled at {low:.0%}-{high:.0%} efficiency"
    if report.get("note"):
        caption = f"[yellow]{report['note']}[/yellow]\n{caption}"
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for column in ("replicas", "images/s", "images/s per replica", "scaling efficiency"):
        table.add_column(column, justify="right")
    base_short = bool(report["rows"] and report["rows"][0].get("too_short"))
    for row in report["rows"]:
        efficiency = row["scaling_efficiency"]
        style = "green" if efficiency >= low else "yellow"
        shown = ("[yellow]too short to measure[/yellow]" if row.get("too_short") or base_short
                 else f"[{style}]{efficiency:.1%}[/{style}]")
        table.add_row(str(row["replicas"]), f"{row['images_per_s']:.1f}", f"{row['images_per_s_per_replica']:.1f}",
                      shown)
    if report.get("vs_ddp") is not None:
        table.add_row("torchrun+DDP", f"{report['ddp_images_per_s']:.1f}", "", f"distrun {report['vs_ddp']:.3f}x")
    return table


def render_straggler(report: Mapping[str, Any]) -> Table:
    title = (f"straggler: {report['workers']} workers, one {report['slow_factor']:g}x slower; async/sync "
             f"{report['ratio']:.2f}x of a {report['bound']:.2f}x bound = {100 * report['fraction_of_bound']:.0f}%")
    table = Table(title=title, title_justify="left")
    for column in ("mode", "batches/s", f"batches to loss {report['target_loss']:g}", "seconds to it", "final loss"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in report["rows"]:
        table.add_row(row["mode"], f"{row['batches_per_s']:.1f}",
                      "-" if row["batches_to_target"] is None else str(row["batches_to_target"]),
                      "-" if row["seconds_to_target"] is None else f"{row['seconds_to_target']:.1f}",
                      "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}")
    return table


def render_allreduce(report: Mapping[str, Any]) -> Table:
    slowest = report.get("link_MBps_min")
    hosts = " + ".join(str(n) for n in report["ranks_per_host"])
    title = (f"all-reduce: {report['world_size']} ranks on {report['hosts']} hosts ({hosts}), mean of "
             f"{report['repeats']}; slowest link {'-' if slowest is None else f'{slowest:.1f} MB/s'}")
    links = ", ".join(f"host {link['from_host']} -> {link['to_host']}: {link['MBps']:.1f} MB/s"
                      for link in report["links"])
    table = Table(title=title, title_justify="left", caption=f"links (raw TCP): {links or 'none'}; "
                  "busbw = algbw x 2(n-1)/n (nccl-tests); MB/s of 10^6 bytes", caption_justify="left")
    for column in ("size (MB)", "algorithm", "time (ms)", "algbw (MB/s)", "busbw (MB/s)", "busbw / slowest link"):
        table.add_column(column, justify="right")
    for row in report["rows"]:
        share = "-" if row.get("of_link") is None else f"{row['of_link']:.2f}"
        table.add_row(f"{row['size_mb']:g}", row["algorithm"], f"{row['time_ms']:.1f}", f"{row['algbw_MBps']:.1f}",
                      f"{row['busbw_MBps']:.1f}", share)
    return table


def _contenders(title: str, caption: str, columns: tuple[str, ...]) -> Table:
    """A table of contenders: named in the first column, figures right-aligned in the others."""
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    return table


def render_compression(report: Mapping[str, Any]) -> Table:
    title = (f"compression: {report['world_size']} ranks, MLP of {report['parameters']:,} parameters, batch "
             f"{report['batch_per_replica']} per replica, {report['timed_steps']} timed steps")
    table = _contenders(title, "loss: training loss after the same steps; digits: recipes/digits.py's held-out "
                        "accuracy under the same compression",
                        ("compression", "samples/s", "vs none", "loss", "digits accuracy"))
    for row in report["rows"]:
        speedup = "-" if row["speedup_vs_none"] is None else f"{row['speedup_vs_none']:.2f}x"
        table.add_row(row["compression"], f"{row['samples_per_s']:.0f}", speedup, f"{row['loss']:.4f}",
                      f"{row['digits_accuracy']:.4f}")
    return table


def render_elastic(report: Mapping[str, Any]) -> Table:
    title = (f"recovery from a lost rank: {report['hosts']} hosts, the last rank killed at step {report['kill_at']} "
             f"of {report['steps']}; checkpoints every {report['checkpoint_every']} steps for the restart")
    table = _contenders(title, "recovery: the rank's exit to the next committed step; back: to a step past the "
                        "one reached before the loss",
                        ("contender", "recovery", "back to the step", "steps redone", "restarts"))
    for row in report["rows"]:
        table.add_row(row["contender"], f"{row['recovery_s']:.2f} s", f"{row['back_s']:.2f} s",
                      str(row["steps_redone"]), str(row["restarts"]))
    if report.get("speedup"):
        table.add_row("restart / elastic", f"{report['speedup']:.2f}x", f"{report['speedup_back']:.2f}x", "", "")
    return table


def render_memory(report: Mapping[str, Any]) -> Table:
    title = (f"MB per rank: {report['parameters']:,} parameters ({report['layers']} x Linear({report['width']})), "
             f"{report['optimizer']}, {report['steps']} steps on the CPU")
    table = _contenders(title, "state: the parameters, gradients and optimizer state a rank holds (its shards under "
                        "sharded); +peak: peak RSS over RSS before the model was built, on rank 0 (sharded's builds "
                        "the seeded model whole once) and the most on any other rank. ratio: sharded / mirrored.",
                        ("strategy", "ranks", "params", "grads", "optim", "state", "+peak r0", "+peak others"))
    ratios = {ratio["replicas"]: ratio for ratio in report["ratios"]}
    for row in report["rows"]:
        first = row["ranks"][0]
        others = "-" if row["added_mb_others"] is None else f"{row['added_mb_others']:.0f}"
        table.add_row(row["strategy"], str(row["replicas"]), f"{first['params_mb']:.0f}", f"{first['grads_mb']:.0f}",
                      f"{first['optimizer_mb']:.0f}", f"{row['state_mb']:.0f}", f"{row['added_mb_rank0']:.0f}", others)
        if row["strategy"] == "sharded":
            ratio = ratios[row["replicas"]]
            others_ratio = f"{ratio['added_others']:.2f}x" if "added_others" in ratio else "-"
            table.add_row("ratio", "", "", "", "", f"{ratio['state']:.2f}x",
                          f"{ratio['added_rank0']:.2f}x", others_ratio, end_section=True)
    return table


def render_pipeline(report: Mapping[str, Any]) -> Table:
    title = (f"pipeline across hosts: MLP of {report['parameters']:,} parameters ({report['layers']} blocks of "
             f"{report['width']}), global batch {report['global_batch_size']}, {report['steps']} steps")
    table = _contenders(title, f"samples/s: the mean after step 1; the goal is at least {report['goal_vs_sharded']:g}x "
                        "sharded for --pp 2", ("contender", "samples/s", "step", "vs sharded", "peak MB"))
    for row in report["rows"]:
        table.add_row(row["contender"], f"{row['samples_per_s']:.1f}",
                      "-" if row["step_s"] is None else f"{row['step_s']:.2f} s",
                      "-" if row["vs_sharded"] is None else f"{row['vs_sharded']:.2f}x",
                      "-" if row["peak_mb"] is None else f"{row['peak_mb']:.0f}")
    return table


def render_layouts(report: Mapping[str, Any]) -> Table:
    title = (f"memory per rank: MLP of {report['parameters']:,} parameters ({report['layers']} blocks of "
             f"{report['width']}), global batch {report['global_batch_size']}, 2 ranks each")
    table = _contenders(title, "peak: the highest rank's peak resident memory (VmHWM, interpreter and torch "
                        "included); rank 0 also built the whole model before splitting it",
                        ("layout", "peak MB", "rank 0", "others", "vs sharded", "samples/s"))
    for row in report["rows"]:
        others = "-" if row["others_peak_mb"] is None else f"{row['others_peak_mb']:.0f}"
        table.add_row(row["layout"], f"{row['peak_mb']:.0f}", f"{row['rank0_peak_mb']:.0f}", others,
                      f"{row['vs_sharded']:.2f}x", f"{row['samples_per_s']:.1f}")
    return table


def render_auto(report: Mapping[str, Any]) -> Table:
    def num(value: Any, form: str) -> str:
        return "-" if value is None else f"{value:{form}}"

    def policy(name: str) -> str:
        failed = report[f"{name}_failed"]
        ratio = report[f"geomean_vs_{name}"]
        return f"ahead without bound (it failed in {failed} scenario(s))" if ratio is None and failed else \
            f"{num(ratio, '.2f')}x"

    table = _contenders(f"--strategy auto against every kind of layout, {report['steps']} steps each",
                        "predicted/measured peak: the highest rank (VmHWM); step: the global batch over samples/s; "
                        "0 samples/s: the run failed (killed over its cgroup's limit). auto's ratio to the best "
                        f"contender: geometric mean {num(report['geomean_vs_best'], '.2f')}x, worst "
                        f"{num(report.get('worst_vs_best'), '.2f')}x; against the best within the 90% rule "
                        f"(a cgroup peak over 90% of the limit is not counted best: marked *) "
                        f"{num(report.get('geomean_vs_best_within_rule'), '.2f')}x, worst "
                        f"{num(report.get('worst_vs_best_within_rule'), '.2f')}x; geometric means against "
                        f"always-mirrored {policy('mirrored')}, always-sharded {policy('sharded')} (a failure counts 0)"
                        + (f"; on the cluster {report['cluster']}" if report.get("cluster") else ""),
                        ("scenario / layout", "samples/s", "peak MB pred/meas", "step s pred/meas", "auto vs it"))
    for row in report["rows"]:
        table.add_section()
        limit = row.get("cgroup_limit_mb")
        table.add_row(f"[bold]{row['scenario']}[/bold] (budget {num(row['budget_mb'], ',.0f')} MB a rank"
                      + (f"; cgroup {limit:,.0f} MB" if limit else "") + ")", "", "", "", "")
        if row.get("plan_error"):
            table.add_row(f"  [red]auto could not plan:[/red] {row['plan_error']}", "", "", "", "")
        rate = row["contenders"][-1]["samples_per_s"]
        for c in row["contenders"]:
            edge = f" (cgroup peak {c['cgroup_peak_mb']:,.0f} MB)" if limit and c.get("cgroup_peak_mb") else ""
            mark = "*" if limit and c["samples_per_s"] and not c.get("within_rule", True) else ""
            table.add_row(f"  {c['layout']}{edge}{mark}", f"{c['samples_per_s']:.1f}",
                          f"{num(c['predicted_peak_mb'], '.0f')}/{num(c['peak_mb'], '.0f')}",
                          f"{num(c['predicted_step_s'], '.3g')}/{num(c['step_s'], '.3g')}",
                          "-" if c["layout"].startswith("auto") else
                          (f"{rate / c['samples_per_s']:.2f}x" if c["samples_per_s"] else "it failed"))
    return table


def render_slowlinks(report: Mapping[str, Any]) -> Table:
    title = (f"slow links: MLP of {report['parameters']:,} parameters, global batch {report['global_batch_size']}, "
             f"{report['steps']} steps each, eval every {report['eval_every']}")
    table = _contenders(title, f"bytes: what the training hosts' interfaces sent, per step; equal time: the eval loss "
                        f"at {report['equal_time_s']:.1f} s (the fastest contender's whole run); to baseline: seconds "
                        "to multi-worker's final eval loss",
                        ("contender", "MB/step", "fewer bytes", "s/step", "eval loss", "at equal time", "to baseline"))

    def num(value: Any, form: str, unit: str = "") -> str:
        return "-" if value is None else f"{value:{form}}{unit}"

    for row in report["rows"]:
        table.add_row(row["contender"], num(None if row["bytes_per_step"] is None else row["bytes_per_step"] / 1e6, ".2f"),
                      num(row["bytes_vs_baseline"], ".1f", "x"), num(row["step_s"], ".3f"), num(row["eval_loss"], ".4f"),
                      num(row["eval_loss_at_equal_time"], ".4f"), num(row["time_to_baseline_loss_s"], ".1f", " s"))
    return table
