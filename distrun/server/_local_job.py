"""A local `distrun train`, listed on this machine's server: `distrun jobs`, `logs`, `attach`,
`stacks` and `cancel` reach it as they reach a cluster job.

A local job is supervised by its own `distrun train` process (the ranks are its children, or
forked for it by the warm interpreter), not by the server, so the server cannot run it: it
keeps its record. The client opens one authenticated connection, asks ``local_job``, and from
then on that connection carries, one frame each:

- client to server: ``{"event": {...}}`` (the launcher's events, as a cluster host's launcher
  records them), ``{"reply": N, "stacks": [...], "dumps": {...}}`` and, last,
  ``{"end": {...}}`` (the result, in the shape a cluster host's job records);
- server to client: ``{"op": "stop", "reason": R}`` (`distrun cancel`: the client stops its
  ranks as on Ctrl-C, and says who stopped it) and ``{"op": "diagnose", "id": N, ...}``
  (`distrun stacks`: the client runs py-spy on its ranks; it is the tracer they allow).

The connection is the job's lease. When it closes without a result (the client was killed; its
ranks died with it), the record ends ``lost``; when the server stops, the job goes on in its
own process and the record says so.
"""

from __future__ import annotations

import itertools
import json
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from distrun.protocol import Event, EventDecodeError, decode_event
from distrun.protocol.wire import Stream, WireError, close, recv_frame, send_frame

__all__ = ["LocalJobChannel", "DIAGNOSE_TIMEOUT_S"]

#: How long `distrun stacks` waits for the client's answer (it dumps the Flight Recorder first:
#: up to 10 s for a rank stuck holding the GIL, then py-spy on every rank).
DIAGNOSE_TIMEOUT_S = 30.0


class LocalJobChannel:
    """The server's end of a local job's connection; stands where a cluster job's launcher does."""

    def __init__(self, conn: Stream, record: Callable[[Event], None], *, warm: bool) -> None:
        """``record``: the job's event log (``JobRecord.record``)."""
        self.warm = warm
        self._conn = conn
        self._record = record
        self._ended = False
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any] | None] = {}
        self._answered = threading.Condition()
        self._closed_here = False  # the server closed it (stopping): not the client's loss

    def serve(self) -> dict[str, Any]:
        """Record the client's events until its result; that result, or why there is none."""
        self._conn.settimeout(None)  # a hung job sends nothing for long; the client's death closes it
        setsockopt = getattr(self._conn, "setsockopt", None)
        if setsockopt is not None:  # a send to a client that stopped reading (SIGSTOP) gives up after 5 s
            setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 5, 0))
        try:
            while True:
                frame = recv_frame(self._conn)
                if "end" in frame:
                    return _result(frame["end"])
                if "reply" in frame:
                    self._answer(frame)
                elif isinstance(frame.get("event"), dict):
                    try:
                        self._record(decode_event(json.dumps(frame["event"])))
                    except EventDecodeError:
                        continue  # a newer client's event: its own `distrun train` shows it
        except (WireError, OSError, ValueError):
            if self._closed_here:
                return {"state": "lost", "failure": None,
                        "error": "the local server stopped while the job ran (its `distrun train` went on and "
                                 "printed the outcome)"}
            return {"state": "lost", "failure": None,
                    "error": "its `distrun train` ended without a result (killed?); its ranks ended with it"}
        finally:
            with self._answered:
                self._ended = True  # a diagnose still waiting gives up now
                self._answered.notify_all()

    # -- what the server's other requests ask of a job's launcher

    def stopping(self, reason: str, **_: Any) -> None:
        self.stop(reason)

    def stop(self, reason: str = "stop requested") -> None:
        self._send({"op": "stop", "reason": reason})

    def preempt(self) -> None:
        """Slurm's warning to an allocation: a local job is not in one."""

    def lose_rank(self, rank: int, why: str) -> None:
        """``--elastic``'s hang handling is the client's own for a local job."""

    def diagnosis(self, *, native: bool = False, flight_recorder: bool = False) -> dict[str, Any]:
        """``distrun stacks``: the client's answer ({"stacks", "dumps"}), as ``LocalLauncher.diagnosis``'s."""
        request_id = next(self._ids)
        with self._answered:
            self._replies[request_id] = None
        self._send({"op": "diagnose", "id": request_id, "native": native, "flight_recorder": flight_recorder})
        with self._answered:
            answered = self._answered.wait_for(lambda: self._replies.get(request_id) is not None
                                               or self._ended, DIAGNOSE_TIMEOUT_S)
            reply = self._replies.pop(request_id, None)
        if not answered or reply is None:
            raise TimeoutError(f"the job's `distrun train` did not answer within {DIAGNOSE_TIMEOUT_S:.0f} s")
        return {"stacks": list(reply.get("stacks") or ()), "dumps": dict(reply.get("dumps") or {})}

    def close(self) -> None:
        """The server is stopping: let go of the job (it runs on in its own process)."""
        self._closed_here = True
        close(self._conn)

    # -- helpers

    def _answer(self, frame: dict[str, Any]) -> None:
        request_id = frame.get("reply")
        with self._answered:
            if isinstance(request_id, int) and request_id in self._replies:
                self._replies[request_id] = frame
                self._answered.notify_all()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            with self._send_lock:
                send_frame(self._conn, message)
        except (WireError, OSError):
            pass  # the client is gone: serve() ends the record


def _result(raw: Any) -> dict[str, Any]:
    """The client's result, in the shape a host's job keeps (unknown keys dropped)."""
    if not isinstance(raw, dict):
        return {"state": "lost", "failure": None, "error": "its `distrun train` sent no readable result"}
    state = str(raw.get("state") or "lost")
    return {"state": state, "failure": raw.get("failure") if isinstance(raw.get("failure"), dict) else None,
            "error": str(raw["error"])[:500] if raw.get("error") else None,
            "returncodes": raw.get("returncodes") if isinstance(raw.get("returncodes"), dict) else {},
            "warm": bool(raw.get("warm")), "reason": str(raw["reason"])[:200] if raw.get("reason") else None}
