"""Drawing a Diagnosed event: every rank's stack collapsed, and the Flight Recorder table.

Sixteen ranks blocked in the same all-reduce are one entry, not sixteen stacks: ranks whose
main threads stand at the same frames collapse together, so the odd one out (the rank the
others wait for) stands alone:

    ranks 0-6, 8-15: all_reduce ← train_step (recipe.py:42)
    rank 7 (10.0.0.3): sleep ← loss (recipe.py:30)
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from distrun.protocol import Diagnosed
from distrun.protocol.diagnosis import Frame, RankStack
from distrun.ui._format import fmt_ranks

__all__ = ["render_diagnosis", "collapse_stacks", "headline"]

#: Frames shown under each entry (innermost first); the rest are counted.
FRAMES_SHOWN = 12


def collapse_stacks(stacks: tuple[RankStack, ...] | list[RankStack]) -> list[tuple[tuple[int, ...], RankStack]]:
    """Ranks whose stacks are the same frame for frame (or that failed alike), the largest
    group first: [(ranks, one of their stacks)]."""
    groups: dict[Any, list[RankStack]] = {}
    for stack in stacks:
        key = ("error", stack.error) if stack.error else tuple((f.function, f.file, f.line) for f in stack.frames)
        groups.setdefault(key, []).append(stack)
    found = [(tuple(sorted(s.rank for s in members)), members[0]) for members in groups.values()]
    return sorted(found, key=lambda group: (-len(group[0]), group[0]))


def headline(frames: tuple[Frame, ...]) -> str:
    """``all_reduce ← train_step (recipe.py:42)``: where the rank is, then the innermost frame
    of the job's own code that led there (or of distrun's loop, for a fit-style recipe)."""
    python = [f for f in frames if f.line > 0]  # native frames say little on one line
    if not python:
        return frames[0].function if frames else "no frame"
    leaf = python[0]
    # The job's own code, else distrun's loop (``train_step``): what led into torch.
    user = next((f for f in python if f.user), None) or next((f for f in python if f.file.startswith("distrun/")), None)
    if user is None:
        return leaf.where()
    if user is leaf:
        return user.where()
    return f"{leaf.function} ← {user.where()}"


def render_diagnosis(diagnosis: Diagnosed, *, full: bool = True) -> Group:
    """The stacks (each entry's frames under it when ``full``), then the collectives."""
    why = "no progress: " if diagnosis.reason == "hang" else ""
    parts: list[Any] = [Text(f"{why}stacks of {len(diagnosis.stacks)} rank(s), same stacks collapsed:", style="bold")]
    for ranks, stack in collapse_stacks(diagnosis.stacks):
        who = fmt_ranks(ranks) + (f" ({stack.host})" if len(ranks) == 1 and stack.host else "")
        if stack.error:
            parts.append(Text(f"{who}: no stack: {stack.error}", style="yellow"))
            continue
        parts.append(Text(f"{who}: {headline(stack.frames)}", style="bold red" if len(ranks) == 1 and
                          len(diagnosis.stacks) > 2 else ""))
        if full:
            for frame in stack.frames[:FRAMES_SHOWN]:
                parts.append(Text(f"    {frame.function} ({frame.file}:{frame.line})" if frame.line
                                  else f"    {frame.function} ({frame.file})", style="" if frame.user else "dim"))
            if len(stack.frames) > FRAMES_SHOWN:
                parts.append(Text(f"    ... {len(stack.frames) - FRAMES_SHOWN} more frame(s)", style="dim"))
    if diagnosis.collectives:
        parts.append(_collectives(diagnosis))
    if diagnosis.awaited is not None:
        line = f"ranks wait in collective {diagnosis.awaited}"
        line += (f"; never entered it: {fmt_ranks(diagnosis.missing)}" if diagnosis.missing
                 else "; every rank entered it")
        parts.append(Text(line, style="bold red" if diagnosis.missing else "bold"))
    if diagnosis.dump_dir:
        parts.append(Text(f"flight recorder dumps: {diagnosis.dump_dir}"))
    return Group(*parts)


def _collectives(diagnosis: Diagnosed) -> Table:
    table = Table(box=box.SIMPLE_HEAD, title="last collective each rank entered (Flight Recorder)", title_justify="left")
    for name in ("rank", "host", "seq", "collective", "sizes", "state"):
        table.add_column(name, justify="right" if name in ("rank", "seq") else "left")
    for record in diagnosis.collectives:
        if record.error:
            table.add_row(str(record.rank), record.host, "-", "-", "-", record.error)
            continue
        state = "done" if record.completed else "waiting"
        if record.rank in diagnosis.missing:
            state = "behind: never entered the awaited collective"
        table.add_row(str(record.rank), record.host, str(record.seq), record.op or "?", record.sizes, state)
    return table
