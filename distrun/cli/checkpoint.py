"""`distrun checkpoint ls DIR` and `distrun checkpoint export DIR -o model.pt` (docs/checkpoints.md).

torch is asked of a short-lived interpreter (``runtime/_checkpoint_tool``): the CLI itself
never imports it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from distrun.cli._app import app, stderr
from distrun.errors import CheckpointError
from distrun.protocol import describe_mesh

checkpoint_app = typer.Typer(help="List checkpoints, or export a model's plain state_dict.", no_args_is_help=True)
app.add_typer(checkpoint_app, name="checkpoint")


def _tool(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "distrun.runtime._checkpoint_tool", *args],  # noqa: S603
                          capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if done.returncode != 0 or "error" in answer or not answer:
        why = answer.get("error") or (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckpointError(why if why.startswith(f"{args[1]}:") else f"{args[1]}: {why}")
    return answer


@checkpoint_app.command("ls")
def ls(
    folder: Path = typer.Argument(..., metavar="DIR", help="A --checkpoint-dir."),
    json_output: bool = typer.Option(False, "--json", help="One JSON object per checkpoint."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Each checkpoint in DIR: its step, the strategy and layout that wrote it (replicas, and under
    --tp each replica's ranks), its size; any layout resumes it."""
    if not folder.is_dir():  # nothing to read: exit 5, as for a folder without checkpoints
        raise CheckpointError(f"{folder}: {'not a folder' if folder.exists() else 'no such folder'}")
    rows = _tool("ls", str(folder))["checkpoints"]
    if json_output:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    table = Table(title=str(folder), title_justify="left")
    names = [Path(row["path"]).name + ("/" if row["format"] == "sharded" else "") for row in rows]
    for name in ("step", "strategy", "layout", "parameters", "size MB", "file"):
        whole = name in ("step", "layout", "file")  # at 80 columns the others wrap, never these
        table.add_column(name, justify="right" if name in ("step", "parameters", "size MB") else "left",
                         no_wrap=whole, min_width=max(map(len, names), default=4) if name == "file" else None)
    for row in rows:
        mesh = row.get("mesh") or {}
        table.add_row(str(row["step"]), str(row["strategy"]), describe_mesh(mesh) or "-",
                      f"{row['parameters']:,}",
                      f"{row['bytes'] / 1e6:.1f}", Path(row["path"]).name + ("/" if row["format"] == "sharded" else ""))
    Console(highlight=False).print(table)


@checkpoint_app.command("export")
def export(
    source: Path = typer.Argument(..., metavar="DIR", help="A --checkpoint-dir (its newest checkpoint), one ckpt-<step>.pt file or one ckpt-<step>/ folder."),
    out: Path = typer.Option(..., "-o", "--out", help="Where to write the plain state_dict (.pt)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Write the model's plain state_dict: `torch.load(OUT, weights_only=True)` reads it without distrun."""
    if not source.exists():
        raise CheckpointError(f"{source}: no such file or folder")
    done = _tool("export", str(source), str(out))
    typer.echo(done["out"])
    stderr.print(f"note: step {done['step']}, {done['tensors']} tensors, {done['parameters']:,} parameters "
                 f"from {done['source']}", markup=False)
