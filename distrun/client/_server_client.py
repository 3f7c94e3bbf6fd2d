"""A connection to one worker server: handshake, then request/response frames."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from distrun.errors import HostError
from distrun.protocol.cluster import ServerInfo
from distrun.protocol.wire import AuthError, Stream, WireError, client_handshake, recv_frame, send_frame


class ServerClient:
    """Talks to the server behind ``stream`` (an SSH channel, or a local socket)."""

    def __init__(self, stream: Stream, token_hex: str, label: str) -> None:
        self.label = label
        self._stream = stream
        self._ids = itertools.count(1)
        try:
            self.hello = client_handshake(stream, bytes.fromhex(token_hex))
        except AuthError as exc:
            stream.close()
            raise HostError(label, f"the worker server refused us: {exc}") from None
        except (WireError, OSError, ValueError) as exc:
            stream.close()
            raise HostError(label, f"no worker server answered the handshake ({exc})") from None

    def call_waiting(self, op: str, wait_s: float, **args: Any) -> dict[str, Any]:
        """``call``, for a request the server may take up to ``wait_s`` to answer (``diagnose``:
        a Flight Recorder dump waits up to 10 s, then py-spy reads every rank)."""
        before = getattr(self._stream, "gettimeout", lambda: None)()
        self._stream.settimeout(wait_s)
        try:
            return self.call(op, **args)
        finally:
            self._stream.settimeout(before)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        try:
            send_frame(self._stream, {"id": request_id, "op": op, "args": args})
            reply = recv_frame(self._stream)
        except (WireError, OSError) as exc:
            raise HostError(self.label, f"lost the worker server during {op!r} ({exc})") from None
        if reply.get("id") != request_id:
            raise HostError(self.label, f"the worker server answered request {reply.get('id')!r}, not {request_id}")
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise HostError(self.label, f"the worker server failed {op!r}: {error.get('message', 'no reason')}")
        result = reply.get("result")
        return result if isinstance(result, dict) else {}

    def hand_over(self, op: str, **args: Any) -> Stream:
        """Ask ``op`` of a request that takes the connection over (``local_job``); once the server
        agrees, the stream is the caller's, for frames both ways, and this client is spent."""
        self.call(op, **args)
        self._stream.settimeout(None)
        return self._stream

    def stream(self, op: str, *, silence_s: float = 5.0, **args: Any) -> Iterator[dict[str, Any]]:
        """Items of a streaming request (``follow``) until the server ends it.

        The server sends a heartbeat every second, so ``silence_s`` without a frame
        means the server (or its host) is gone: that is reported, not waited out.
        """
        request_id = next(self._ids)
        self._stream.settimeout(silence_s)
        try:
            send_frame(self._stream, {"id": request_id, "op": op, "args": args})
            while True:
                reply = recv_frame(self._stream)
                if not reply.get("ok"):
                    error = reply.get("error") or {}
                    raise HostError(self.label, f"the worker server failed {op!r}: {error.get('message', 'no reason')}")
                if reply.get("end"):
                    return
                item = reply.get("item")
                if isinstance(item, dict):
                    yield item
        except TimeoutError:
            raise HostError(self.label, f"the worker server went silent for {silence_s:g} s during {op!r}") from None
        except (WireError, OSError) as exc:
            raise HostError(self.label, f"lost the worker server during {op!r} ({exc})") from None

    def status(self) -> tuple[ServerInfo, float]:
        """The server's status and the round trip it took, in milliseconds."""
        t0 = time.perf_counter()
        result = self.call("status")
        rtt_ms = (time.perf_counter() - t0) * 1000.0
        try:
            return ServerInfo.from_dict(result), rtt_ms
        except (ValueError, TypeError) as exc:
            raise HostError(self.label, f"the worker server sent a malformed status: {exc}") from None

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
