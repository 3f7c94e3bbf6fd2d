"""Which network interface leads to the chief: gloo and NCCL must be told.

gloo takes its address from the host name unless GLOO_SOCKET_IFNAME says
otherwise, and the host name often resolves to loopback (or to the wrong
network on multi-homed hosts). The kernel already knows the answer: a UDP
socket "connected" to the chief (no packet is sent) has the local address the
route to it uses, and that address belongs to exactly one interface.
"""

from __future__ import annotations

import socket

import psutil


def interface_towards(address: str, port: int = 9) -> str | None:
    """The interface the route to ``address`` leaves by, or None if it cannot be told."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, port))
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(addr.address.split("%")[0] == local for addr in addrs):
            return name
    return None
