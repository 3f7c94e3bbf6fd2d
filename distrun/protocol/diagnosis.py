"""What a look inside a running job finds: each rank's stack and its last collectives.

``distrun stacks`` and ``--hang-timeout-s`` gather these from every host (py-spy for the
stacks, torch's Flight Recorder for the collectives); the client collapses them into one
report. Plain frozen dataclasses with a JSON form: they cross the wire from the worker
servers, so no pickle, and a reader of ``--json`` gets the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Frame", "RankStack", "CollectiveRecord", "flight_recorder_file"]


@dataclass(frozen=True)
class Frame:
    """One Python frame; ``user``: the job's own code (not torch, distrun, the standard
    library or an installed package), where a report points first."""

    function: str
    file: str
    line: int
    user: bool = False

    @classmethod
    def from_dict(cls, data: Any) -> Frame:
        return data if isinstance(data, Frame) else cls(str(data["function"]), str(data["file"]), int(data["line"]),
                                                       bool(data.get("user", False)))

    def where(self) -> str:
        """``train_step (recipe.py:42)``."""
        return f"{self.function} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


@dataclass(frozen=True)
class RankStack:
    """A rank's main thread at one moment, innermost frame first; ``error``: why there is none."""

    rank: int
    host: str
    pid: int
    frames: tuple[Frame, ...] = ()
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "frames", tuple(Frame.from_dict(f) for f in self.frames))  # JSON brings dicts

    @classmethod
    def from_dict(cls, data: Any) -> RankStack:
        if isinstance(data, RankStack):
            return data
        return cls(rank=int(data["rank"]), host=str(data.get("host", "")), pid=int(data.get("pid", 0)),
                   frames=tuple(data.get("frames") or ()), error=data.get("error"))


@dataclass(frozen=True)
class CollectiveRecord:
    """The last collective a rank entered, from its Flight Recorder (torch's ring of every
    collective the process group ran): ``seq`` counts the group's collectives, so ranks at a
    lower ``seq`` than the others never entered the one they wait in."""

    rank: int
    host: str
    group: str = ""  # the process group's name ("0" is the default group)
    seq: int | None = None
    op: str | None = None  # torch's profiling name, e.g. "gloo:all_reduce"
    sizes: str = ""  # input sizes and dtypes, e.g. "[1000] Float"
    completed: bool = False
    recorded: int = 0  # entries in the ring
    error: str | None = None  # why there is no record (no process group, torch too old, no answer)

    @classmethod
    def from_dict(cls, data: Any) -> CollectiveRecord:
        return data if isinstance(data, CollectiveRecord) else cls(**data)


def flight_recorder_file(rank: int) -> str:
    """The file a rank writes its Flight Recorder dump to, in the job's debug folder."""
    return f"flight-recorder-rank-{rank}.json"
