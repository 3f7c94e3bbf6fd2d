"""``python -m distrun.server relay --port P``: stdin and stdout joined to this host's server.

On a Slurm node the client has no SSH channel to forward a port through; it runs
this inside an ``srun`` step instead, and the step's stdin and stdout carry the
server's wire protocol (token handshake included) byte for byte. The relay
connects only to loopback, where the server listens, and ends when either side
does: the client closing the step's stdin, or the server closing the connection.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

_CHUNK_BYTES = 1 << 16


def relay(port: int) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # Slurm's warning to every step is not for a relay
    try:
        server = socket.create_connection(("127.0.0.1", port), timeout=10.0)
    except OSError as exc:
        print(f"no worker server answers on 127.0.0.1:{port} ({exc.strerror or exc})", file=sys.stderr)
        return 1
    server.settimeout(None)

    def upstream() -> None:  # the client's bytes (srun's stdin) to the server
        try:
            while chunk := os.read(0, _CHUNK_BYTES):
                server.sendall(chunk)
        except OSError:
            pass
        finally:
            try:
                server.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    threading.Thread(target=upstream, daemon=True).start()
    try:
        while chunk := server.recv(_CHUNK_BYTES):
            view = memoryview(chunk)
            while view:
                view = view[os.write(1, view):]
    except OSError:
        return 1
    finally:
        server.close()
    return 0
