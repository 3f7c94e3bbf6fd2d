"""A cluster's hosts as specs: who a host is (roles), how to log in (SSH), where traffic goes.

Kept apart from the cluster file's parser (``config/cluster``) so that the ``slurm:`` section
(``config/_slurm``), whose allocation lists hosts, and the parser both import these and
neither imports the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Role", "SshSpec", "NetworkSpec", "HostSpec", "DEFAULT_SSH_PORT", "DEFAULT_CONNECT_TIMEOUT_S",
           "DEFAULT_WORKDIR", "DEFAULT_PYTHON", "DEFAULT_KNOWN_HOSTS"]

DEFAULT_SSH_PORT = 22
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_WORKDIR = "~/.distrun"
DEFAULT_PYTHON = "python3"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


class Role(str, Enum):
    """TensorFlow's task types."""

    CHIEF = "chief"
    WORKER = "worker"
    PS = "ps"
    EVALUATOR = "evaluator"


@dataclass(frozen=True)
class SshSpec:
    """How to log in to a host. Local paths are already expanded and absolute."""

    user: str | None = None
    port: int = DEFAULT_SSH_PORT
    identity_file: str | None = None
    known_hosts: str = field(default_factory=lambda: os.path.expanduser(DEFAULT_KNOWN_HOSTS))
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    accept_new_host_keys: bool = False


@dataclass(frozen=True)
class NetworkSpec:
    """Where training traffic goes: the interface for gloo/NCCL and the rendezvous ports."""

    interface: str | None = None
    port_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class HostSpec:
    address: str
    roles: tuple[Role, ...]
    ssh: SshSpec
    python: str
    gpus: int | None = None  # None: "auto", detected by the worker server
    slots: int | None = None  # None: the GPU count, else 1

    @property
    def label(self) -> str:
        """How messages and tables name this host: the address, plus the port if not 22."""
        return self.address if self.ssh.port == DEFAULT_SSH_PORT else f"{self.address}:{self.ssh.port}"

    @property
    def state_id(self) -> str:
        """Folder name of this host's state under the workdir.

        Keyed by address and port as the cluster file gives them, not by the
        host's own name: hosts that share a home directory over NFS (or test
        hosts that share one filesystem) then never touch each other's files.
        """
        base = self.address.replace(":", "_")
        return base if self.ssh.port == DEFAULT_SSH_PORT else f"{base}_{self.ssh.port}"

    @property
    def is_chief(self) -> bool:
        return Role.CHIEF in self.roles
