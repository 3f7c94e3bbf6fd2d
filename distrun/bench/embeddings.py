"""`distrun bench embeddings`: samples/s and bytes a step of mirrored against ``--embeddings ps``,
on a model whose embedding table dominates, in one run on this machine.

Two ``distrun train`` runs of ``_embeddings_recipe.py`` (an ``nn.Embedding`` of ``rows x dim``
and a small MLP, plain SGD), one after the other, each on two replicas and the same batches:

- ``mirrored x2``: DDP all-reduces every parameter's gradient each step, the whole table's
  included (``nn.Embedding``'s gradient is dense). Its bytes a step are the model's parameter
  bytes, counted here from the recipe's shapes (mirrored reports none of its own).
- ``mirrored x2 --embeddings ps``: the table on one ps task, split by rows; each replica pulls
  the rows its batch looks up and pushes their gradients, and DDP all-reduces the MLP's. Its
  bytes a step are what the run's summary reports (``embedding_bytes_per_step``,
  ``dense_grad_bytes_per_step``: each replica's mean).

samples/s is each run's summary's (from the end of step 1 to the last). Never imports torch;
the recipe does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from rich.table import Table

from distrun.bench._runs import HERE, run_command

__all__ = ["run_embeddings", "render_embeddings", "parameters"]

_RECIPE = HERE / "_embeddings_recipe.py"
_HIDDEN = 64  # _embeddings_recipe.HIDDEN
_FP32 = 4


def parameters(rows: int, dim: int) -> tuple[int, int]:
    """(the table's, the MLP's) parameter counts of ``_embeddings_recipe.py``'s model."""
    return rows * dim, dim * _HIDDEN + _HIDDEN + _HIDDEN + 1


def run_embeddings(*, rows: int = 1_000_000, dim: int = 32, batch: int = 512, steps: int = 20,
                   progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The report: one row per contender (samples_per_s, table and dense bytes a step, final_loss),
    and the ratios of ``--embeddings ps`` to mirrored."""
    table, mlp = parameters(rows, dim)
    table_mb = table * _FP32 / 2**20
    partition_mb = f"{min(1.0, table_mb / 2):g}"  # the table goes to the ps task; nothing else is an embedding
    contenders = (
        ("mirrored x2", ("-s", "mirrored", "--replicas", "2")),
        ("--embeddings ps", ("-s", "mirrored", "--replicas", "2", "--embeddings", "ps", "--ps-tasks", "1",
                                         "--ps-partition-mb", partition_mb)),
    )
    env = dict(os.environ)
    runs: list[dict[str, Any]] = []
    for name, flags in contenders:
        progress(f"{name}: {steps} steps")
        argv = [sys.executable, "-m", "distrun", "train", str(_RECIPE), *flags, "--device", "cpu", "--json",
                "--steps", str(steps), "--global-batch-size", str(batch), "--",
                "--rows", str(rows), "--dim", str(dim), "--samples", str(batch * steps)]
        out = run_command(argv, env)[1]
        summary = next(line for line in reversed(out) if line.get("type") == "summary")
        if summary.get("embedding_bytes_per_step") is None:  # mirrored: DDP carries every parameter's gradient
            table_bytes, dense_bytes, how = float(table * _FP32), float(mlp * _FP32), "all-reduced whole"
        else:
            table_bytes, dense_bytes = float(summary["embedding_bytes_per_step"]), float(summary["dense_grad_bytes_per_step"])
            how = "rows pulled + pushed"
        runs.append({"contender": name, "samples_per_s": float(summary["samples_per_s"]),
                     "table_bytes_per_step": table_bytes, "table_traffic": how,
                     "dense_grad_bytes_per_step": dense_bytes, "bytes_per_step": table_bytes + dense_bytes,
                     "final_loss": summary.get("final_loss")})
    mirrored, ps = runs
    return {"benchmark": "embeddings", "table_rows": rows, "dim": dim, "table_mb": round(table_mb, 1),
            "dense_parameters": mlp, "global_batch_size": batch, "steps": steps, "replicas": 2, "ps_tasks": 1,
            "rows": runs,
            "ps_vs_mirrored": {"samples_per_s": ps["samples_per_s"] / mirrored["samples_per_s"],
                               "bytes_per_step": ps["bytes_per_step"] / mirrored["bytes_per_step"]}}


def _bytes(count: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}"
    return f"{count:.0f} B"


def render_embeddings(report: Mapping[str, Any]) -> Table:
    """The table, and the ratios in its caption."""
    ratio = report["ps_vs_mirrored"]
    table = Table(title=f"embeddings: a {report['table_rows']:,} x {report['dim']} table ({report['table_mb']:g} MB) "
                        f"and an MLP of {report['dense_parameters']:,} parameters, global batch "
                        f"{report['global_batch_size']}, 2 replicas, {report['steps']} steps",
                  title_justify="left",
                  caption="bytes a step on a replica: the table's (mirrored all-reduces its whole gradient; "
                          "--embeddings ps pulls the rows a batch looks up and pushes their gradients), the dense "
                          "gradients' and their total.\n"
                          f"--embeddings ps vs mirrored x2: {ratio['samples_per_s']:.2f}x the samples/s, "
                          f"{ratio['bytes_per_step']:.2g}x the bytes a step (1/{1 / ratio['bytes_per_step']:,.0f})",
                  caption_justify="left")
    for column in ("contender", "samples/s", "table", "dense", "total", "loss"):
        table.add_column(column, justify="left" if column == "contender" else "right", no_wrap=True)
    for row in report["rows"]:
        loss = "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}"
        table.add_row(row["contender"], f"{row['samples_per_s']:,.0f}", _bytes(row["table_bytes_per_step"]),
                      _bytes(row["dense_grad_bytes_per_step"]), _bytes(row["bytes_per_step"]), loss)
    return table
