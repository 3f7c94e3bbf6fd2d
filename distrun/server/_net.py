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


def address_to_bind(address: str, interface: str | None = None) -> str | None:
    """This host's address on the cluster network: what a job's listeners bind (never every
    interface). ``interface`` (``network.interface``) decides when set; else ``address``, this
    host as the cluster file names it, if it is one of this host's addresses; else the
    address the route to it leaves from. None if none of these can be told."""
    local = _local_addresses()
    if interface:
        found = [addr.address for addr in psutil.net_if_addrs().get(interface, ())
                 if addr.family in (socket.AF_INET, socket.AF_INET6)]
        return next((a for a in found if ":" not in a), found[0].split("%")[0] if found else None)
    try:
        resolved = [info[4][0] for info in socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)]
    except OSError:
        return None
    resolved.sort(key=lambda a: ":" in a)  # IPv4 first
    for candidate in resolved:
        if candidate in local:
            return candidate
    for candidate in resolved:
        try:
            family = socket.AF_INET6 if ":" in candidate else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((candidate, 9))
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def _local_addresses() -> set[str]:
    return {addr.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for addr in addrs
            if addr.family in (socket.AF_INET, socket.AF_INET6)}
