"""A rank's side of ``--hang-timeout-s`` and ``distrun stacks``: its Flight Recorder, on request.

torch's Flight Recorder keeps a ring of the collectives each process group ran (sequence
number, op, sizes, state); distrun turns it on for every job (``TORCH_FR_BUFFER_SIZE``). A
hung rank's main thread is blocked in a collective or in the recipe, so the dump cannot be
asked of it: a daemon thread waits on a pipe from the launcher instead, and writes the dump
(JSON, torch's own format) into the job's debug folder when a byte arrives. gloo's ``wait``
releases the GIL, so the thread runs while the main thread waits in a collective.

The rank also names its launcher as a tracer it accepts (Yama's ``PR_SET_PTRACER``): the
launcher's py-spy is not an ancestor of a rank forked by the warm interpreter, and Yama's
default (``ptrace_scope`` 1) lets only ancestors read a process's stack.
"""

from __future__ import annotations

import ctypes
import os
import threading

from distrun.protocol.diagnosis import flight_recorder_file
from distrun.protocol.environment import DEBUG_DIR_VAR, DIAGNOSE_FD_VAR, SUPERVISOR_PID_VAR

__all__ = ["start_dump_listener", "dump_flight_recorder", "allow_supervisor_to_trace"]

_PR_SET_PTRACER = 0x59616D61  # linux/prctl.h (Yama)


def allow_supervisor_to_trace() -> None:
    """Let the launcher and its children (py-spy) read this process's stack under Yama."""
    pid = os.environ.get(SUPERVISOR_PID_VAR)
    if not pid or not pid.isdigit():
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, int(pid), 0, 0, 0)
    except (OSError, AttributeError):  # no Yama, or not Linux: nothing to allow
        pass


def dump_flight_recorder(rank: int) -> str | None:
    """Write this rank's Flight Recorder into the debug folder (atomically); its path, or None
    when the job has no folder. A rank without a process group writes torch's empty record."""
    folder = os.environ.get(DEBUG_DIR_VAR)
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    target = os.path.join(folder, flight_recorder_file(rank))
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "wb") as out:
        out.write(_dump())
    os.replace(tmp, target)
    return target


def _dump() -> bytes:
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
    except ImportError as exc:
        return _error(f"torch.distributed unavailable: {exc}")
    # NCCL keeps its own ring; gloo (and every other backend) the generic one.
    uses_nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    names = ("_dump_nccl_trace_json", "_dump_fr_trace_json") if uses_nccl else ("_dump_fr_trace_json",)
    for name in names:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            data = dump(True, False)  # every collective in the ring, completed ones too
        except RuntimeError as exc:
            return _error(f"{name}: {exc}")
        return data if isinstance(data, bytes) else str(data).encode()
    return _error(f"this torch ({_torch_version()}) has no Flight Recorder dump")


def _error(text: str) -> bytes:
    import json

    return json.dumps({"error": text}).encode()


def _torch_version() -> str:
    try:
        import torch

        return str(torch.__version__)
    except ImportError:
        return "none"


def start_dump_listener(rank: int) -> None:
    """Dump whenever the launcher writes a byte to our pipe; end when it closes the pipe."""
    fd = os.environ.get(DIAGNOSE_FD_VAR)
    if not fd or not fd.isdigit():
        return
    pipe = int(fd)

    def listen() -> None:
        while True:
            try:
                asked = os.read(pipe, 64)
            except OSError:
                return
            if not asked:
                return
            try:
                dump_flight_recorder(rank)
            except Exception as exc:  # noqa: BLE001 - a failed dump must not end the rank
                try:
                    folder = os.environ.get(DEBUG_DIR_VAR, ".")
                    with open(os.path.join(folder, flight_recorder_file(rank)), "wb") as out:
                        out.write(_error(f"{type(exc).__name__}: {exc}"))
                except OSError:
                    pass

    threading.Thread(target=listen, name="distrun-flight-recorder", daemon=True).start()
