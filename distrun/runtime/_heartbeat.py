"""A heartbeat from every training process, saying where its main thread is.

A rank that hangs in its own code and the ranks blocked in a collective waiting
for it all stop making steps; only the main thread's innermost Python frame
tells them apart. Every HEARTBEAT_INTERVAL_S a daemon thread reports it: ``"torch"``
(inside torch: a collective, backward, an optimizer step), ``"recipe FILE:LINE"``,
or ``"distrun"``. A rank stuck in C code that holds the GIL sends no heartbeat
at all, which the client reads as hung too.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from distrun.protocol import HEARTBEAT_INTERVAL_S, Heartbeat
from distrun.runtime._process import EventWriter
_TORCH_DIR = f"{os.sep}torch{os.sep}"


def where_is(thread_id: int, recipe_dir: str) -> str:
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "distrun"
    path = frame.f_code.co_filename
    if os.path.dirname(os.path.abspath(path)) == recipe_dir:
        return f"recipe {os.path.basename(path)}:{frame.f_lineno}"
    if _TORCH_DIR in path:
        return "torch"
    return "distrun"


def start_heartbeat(writer: EventWriter, rank: int, recipe: str) -> None:
    main_id = threading.main_thread().ident
    recipe_dir = os.path.dirname(os.path.abspath(recipe))

    def beat() -> None:
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            writer.emit(Heartbeat(rank=rank, time=time.time(), where=where_is(main_id or 0, recipe_dir)))

    threading.Thread(target=beat, name="distrun-heartbeat", daemon=True).start()
