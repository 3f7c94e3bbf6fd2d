"""Links to hosts: paramiko connections (one per host, lazy), this machine without SSH, and
the nodes of a Slurm allocation through ``srun``.

Everything returns ``Result`` objects or raises ``HostError`` naming the host;
remote commands are always argv lists quoted with ``shlex`` (``command_line``).
"""

from distrun.links.ssh import Connection, known_hosts_name
from distrun.links.api import CommandFailed, RawResult, Remote, Result, command_line, last_line
from distrun.links.local import LocalConnection
from distrun.links.srun import SrunLink, srun_argv

__all__ = ["Connection", "LocalConnection", "SrunLink", "Remote", "Result", "RawResult", "CommandFailed",
           "command_line", "known_hosts_name", "last_line", "srun_argv"]
