"""The chief host's store, in a network of its own: the host's other users cannot reach it.

A cluster job's store lives on the chief host. Its ranks there cannot move into a private network
as a local job's do (``launch/_netns``): gloo's pairs and NCCL's sockets must reach the other hosts.
So only the store moves: the holder of a private network makes the store's listening socket inside
it, and rank 0 (or the elastic agent) hosts the store on that socket from the machine's network
(a listening socket stays in the namespace it was made in, whoever accepts on it).

Nothing outside the namespace can reach the store then, so two doors lead in, both made by the
holder connecting inside on the launcher's behalf (``PrivateNetwork.connect``):

- this host's ranks use a :class:`StoreRelay` on 127.0.0.1 of the machine's network, which takes
  only processes of the launcher's uid (the kernel's socket table says who owns a peer). It holds
  the same port number as the store inside: torch's TCPStore connects rank 0's own client to its
  host address at the port its server listens on, so that client lands on the relay too;
- other hosts come in through the :class:`StoreFront`, proving the job secret, as before.

The relay binds its port first and the store takes the same number inside the new namespace,
where every port is free: no other process can hold it in between. Where no private network can
be made (user namespaces off), the store listens on the host's loopback as it did before, which the
job's log says in one line.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from distrun.launch._netns import NetworkUnavailable, PrivateNetwork
from distrun.launch._store_relay import StoreFront, StoreRelay, loopback_listener

__all__ = ["ChiefStore"]

_CONNECT_S = 5.0


class ChiefStore:
    """The store's socket (for rank 0 or the agent), the port this host's ranks use, and both
    doors in. ``close()`` ends the front, the relay and the private network."""

    def __init__(self, note: Callable[[str], None], front: tuple[socket.socket, bytes] | None = None) -> None:
        """``front``: the rendezvous listener on the cluster address and the job secret, for the
        :class:`StoreFront` other hosts come in by (none: a test's store alone)."""
        self._note = note
        self._said_gone = False
        self._closed = False
        self.network: PrivateNetwork | None = None
        self.relay: StoreRelay | None = None
        self.front: StoreFront | None = None
        relay_listener = loopback_listener()
        port = int(relay_listener.getsockname()[1])
        try:
            self.network = PrivateNetwork.open()
            self.listener = self.network.listener(port)
        except (NetworkUnavailable, OSError) as exc:
            relay_listener.close()
            if self.network is not None:
                self.network.close()
                self.network = None
            note(f"the job's store listens on this host's loopback, which its other users can reach: no private "
                 f"network here ({exc}); docs/security.md#co-tenants")
            self.listener = loopback_listener()
            self.port = int(self.listener.getsockname()[1])
        else:
            self.port = port
        try:
            if self.network is not None:
                self.relay = StoreRelay(self.connect, note, relay_listener)
            if front is not None:
                self.front = StoreFront(front[0], front[1], self.connect, note)
        except BaseException:
            relay_listener.close()
            self.listener.close()
            self.close()
            raise

    def connect(self) -> socket.socket:
        """A connection to the store: made inside its network by the holder (else on loopback)."""
        if self.network is None:
            return socket.create_connection(("127.0.0.1", self.port), timeout=_CONNECT_S)
        try:
            return self.network.connect(self.port)
        except OSError as exc:
            if self.network.holder_ended() and not self._said_gone and not self._closed:
                self._said_gone = True  # once: each rank's retry would say it again
                self._note(f"the store's private network is gone (its holder, pid {self.network.holder_pid}, "
                           f"ended): no new connection reaches the store ({exc})")
            raise

    @property
    def private(self) -> bool:
        return self.network is not None

    def close(self) -> None:
        self._closed = True
        for door in (self.front, self.relay):
            if door is not None:
                door.close()
        if self.network is not None:
            self.network.close()
