"""Links to hosts: paramiko connections (one per host, lazy) and this machine without SSH.

Everything returns ``Result`` objects or raises ``HostError`` naming the host;
remote commands are always argv lists quoted with ``shlex`` (``command_line``).
"""

from distrun.ssh._connection import Connection, known_hosts_name
from distrun.ssh._local import LocalConnection
from distrun.ssh.api import CommandFailed, Remote, Result, command_line

__all__ = ["Connection", "LocalConnection", "Remote", "Result", "CommandFailed", "command_line", "known_hosts_name"]
