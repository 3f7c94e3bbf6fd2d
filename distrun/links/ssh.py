"""One paramiko connection per host, opened lazily and reused for everything.

Commands, SFTP reads and the channel to the worker server all ride the same
SSH transport. What users of other launchers trip over is handled here, each
failure a ``HostError`` that starts with the host's name:

- unreachable hosts fail within ``connect_timeout_s`` (the TCP connect is ours,
  with that timeout, not the OS's two-minute default);
- host keys are checked against ``known_hosts``; an unknown key is refused with
  its SHA256 fingerprint and the command to accept it, unless the cluster file
  opts in with ``ssh.accept_new_host_keys: true`` (then it is appended to
  known_hosts, never silently); a changed key is always refused;
- sshd throttling is retried with backoff: MaxStartups drops new connections
  before the banner, MaxSessions refuses channels past its limit;
- a port that accepts TCP but never sends an SSH banner (another service, a hung
  sshd) is one line, ``gpu-1:22: no SSH server answered within 10 s``, not taken
  for throttling: throttling closes the connection at once, silence waits out the
  timeout. paramiko's own logging (tracebacks from its transport thread) is kept
  from printing.
"""

from __future__ import annotations

import io
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import paramiko

from distrun.config import DEFAULT_SSH_PORT, HostSpec
from distrun.errors import HostError, HostKeyError, HostUnreachable
from distrun.links.api import RawResult, Result, command_line, last_line
from distrun.protocol.wire import Stream

T = TypeVar("T")

# paramiko logs a traceback per failed handshake from its own thread; distrun's one-line errors
# say what happened, so none of it reaches the terminal.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

#: Attempts when sshd throttles (MaxStartups, MaxSessions); the waits double from the first.
THROTTLE_ATTEMPTS = 7
THROTTLE_FIRST_WAIT_S = 0.2
THROTTLE_MAX_WAIT_S = 3.0


class _Throttled(Exception):
    """sshd turned us away for now (too many startups or sessions); worth retrying."""


def known_hosts_name(address: str, port: int) -> str:
    """The name OpenSSH files a host's key under: ``addr`` on port 22, else ``[addr]:port``."""
    return address if port == DEFAULT_SSH_PORT else f"[{address}]:{port}"


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown keys with their fingerprint, or append them when the user opted in."""

    def __init__(self, host: HostSpec) -> None:
        self.host = host

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        ssh = self.host.ssh
        name = known_hosts_name(self.host.address, ssh.port)
        if not ssh.accept_new_host_keys:
            port = f"-p {ssh.port} " if ssh.port != DEFAULT_SSH_PORT else ""
            raise HostKeyError(
                self.host.label,
                f"unknown host key {key.get_name()} {key.fingerprint}, refused: it is not in {ssh.known_hosts}. "
                f"If that fingerprint is the host's, run `ssh-keyscan {port}{self.host.address} >> {ssh.known_hosts}`, "
                f"or set ssh.accept_new_host_keys: true to trust new hosts on first use",
            )
        entry = paramiko.hostkeys.HostKeyEntry([name], key)
        directory = os.path.dirname(ssh.known_hosts)
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        fd = os.open(ssh.known_hosts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as handle:
            handle.write(entry.to_line())


class Connection:
    """An SSH connection to one host of a cluster file; hashable by (address, user, port).

    Opens on first use; ``close()`` (or leaving a ``with`` block) ends it. Safe to
    share between threads: paramiko multiplexes channels over one transport.
    """

    def __init__(self, host: HostSpec) -> None:
        self.host = host
        self.label = host.label
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._no_sftp = False  # the host has no sftp subsystem: files go over exec channels
        self._lock = threading.Lock()

    def __hash__(self) -> int:
        return hash((self.host.address, self.host.ssh.user, self.host.ssh.port))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Connection) and (self.host.address, self.host.ssh.user, self.host.ssh.port) == (
            other.host.address, other.host.ssh.user, other.host.ssh.port)

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- opening

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            if self._client is None:
                self._client = _retry(self._connect_once, self.label, "connect", HostUnreachable)
            transport = self._client.get_transport()
            if transport is None or not transport.is_active():
                raise HostUnreachable(self.label, "the SSH connection dropped")
            return transport

    def _connect_once(self) -> paramiko.SSHClient:
        ssh = self.host.ssh
        timeout_s = ssh.connect_timeout_s
        try:
            sock = socket.create_connection((self.host.address, ssh.port), timeout=timeout_s)
        except TimeoutError:
            raise HostUnreachable(self.label, f"unreachable: no answer on port {ssh.port} within {timeout_s:g} s") from None
        except ConnectionRefusedError:
            raise HostUnreachable(self.label, f"unreachable: connection refused on port {ssh.port} (is sshd running?)") from None
        except socket.gaierror as exc:
            raise HostUnreachable(self.label, f"unknown host name ({exc.strerror})") from None
        except OSError as exc:
            raise HostUnreachable(self.label, f"unreachable: {exc.strerror or exc}") from None
        client = paramiko.SSHClient()
        if os.path.exists(ssh.known_hosts):
            try:
                client.load_host_keys(ssh.known_hosts)
            except (OSError, paramiko.SSHException) as exc:
                sock.close()
                raise HostKeyError(self.label, f"cannot read known_hosts {ssh.known_hosts}: {exc}") from None
        client.set_missing_host_key_policy(_HostKeyPolicy(self.host))
        started = time.monotonic()
        try:
            client.connect(
                self.host.address, port=ssh.port, username=ssh.user, sock=sock,
                key_filename=ssh.identity_file, allow_agent=True, look_for_keys=ssh.identity_file is None,
                timeout=timeout_s, banner_timeout=timeout_s, auth_timeout=timeout_s, channel_timeout=timeout_s,
            )
        except HostError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            name = known_hosts_name(self.host.address, ssh.port)
            raise HostKeyError(
                self.label,
                f"HOST KEY CHANGED: offered {exc.key.get_name()} {exc.key.fingerprint}, known_hosts has "
                f"{exc.expected_key.fingerprint}; refused (this can be a man-in-the-middle). If the host was "
                f"reinstalled, remove the old key with `ssh-keygen -R '{name}' -f {ssh.known_hosts}`",
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            how = f"identity file {ssh.identity_file}" if ssh.identity_file else "the SSH agent and default keys"
            raise HostUnreachable(self.label, f"authentication refused for user {ssh.user or os.environ.get('USER', '?')} "
                                        f"with {how} ({exc})") from None
        except (paramiko.SSHException, EOFError, ConnectionResetError) as exc:
            transport = client.get_transport()
            silent = not getattr(transport, "remote_version", "")  # no banner came; paramiko then says
            client.close()                                       # "No existing session" or "...banner"
            banner = "banner" in str(exc).lower()
            if silent and time.monotonic() - started >= timeout_s * 0.9:  # silence, not a refusal
                raise HostUnreachable(f"{self.host.address}:{ssh.port}",
                                      f"no SSH server answered within {timeout_s:g} s") from None
            if banner or isinstance(exc, (EOFError, ConnectionResetError)):
                raise _Throttled(str(exc)) from None
            if "no authentication methods" in str(exc).lower():
                raise HostUnreachable(self.label, "no SSH key to log in with: set ssh.identity_file or start an agent") from None
            raise HostUnreachable(self.label, f"SSH failed: {exc}") from None
        except OSError as exc:
            client.close()
            raise HostUnreachable(self.label, f"SSH failed: {exc.strerror or exc}") from None
        return client

    def _session(self) -> paramiko.Channel:
        transport = self._transport()

        def open_once() -> paramiko.Channel:
            try:
                return transport.open_session(timeout=self.host.ssh.connect_timeout_s)
            except paramiko.ChannelException as exc:  # MaxSessions: the open is refused
                raise _Throttled(str(exc)) from None
            except paramiko.SSHException as exc:
                # paramiko keeps one "last failure" per transport, so a refusal seen by a
                # concurrent opener shows up here as a bare "Unable to open channel".
                if transport.is_active() and "unable to open channel" in str(exc).lower():
                    raise _Throttled(str(exc)) from None
                raise HostError(self.label, f"cannot open an SSH session: {exc}") from None

        return _retry(open_once, self.label, "open a session")

    # -- the Remote contract

    def run(self, argv: Sequence[str], *, stdin: str | None = None, timeout_s: float = 60.0) -> Result:
        line, code, out, err = self._exec(argv, stdin.encode() if stdin else None, timeout_s)
        return Result(line, code, out.decode(errors="replace"), err.decode(errors="replace"))

    def run_raw(self, argv: Sequence[str], *, stdin: bytes | None = None, timeout_s: float = 60.0) -> RawResult:
        return RawResult(*self._exec(argv, stdin, timeout_s))

    def open_command(self, argv: Sequence[str]) -> Stream:
        line = command_line(argv)
        channel = self._session()
        try:
            channel.exec_command(line)
        except paramiko.SSHException as exc:
            channel.close()
            raise HostError(self.label, f"cannot run `{line[:80]}`: {exc}") from None
        return _ChannelStream(channel)

    def _exec(self, argv: Sequence[str], stdin: bytes | None, timeout_s: float) -> tuple[str, int, bytes, bytes]:
        """Run ``argv`` (quoted) on the host: (the command line, exit code, stdout, stderr)."""
        line = command_line(argv)
        channel = self._session()
        try:
            channel.settimeout(timeout_s)
            channel.exec_command(line)
            if stdin:
                channel.sendall(stdin)
            channel.shutdown_write()
            errors: list[bytes] = []
            reader = threading.Thread(target=lambda: errors.append(channel.makefile_stderr("rb").read()), daemon=True)
            reader.start()
            out = channel.makefile("rb").read()
            reader.join(timeout_s)
            if not channel.status_event.wait(timeout_s):
                raise TimeoutError
            code = channel.recv_exit_status()
        except (TimeoutError, socket.timeout):
            raise HostError(self.label, f"`{line[:80]}` did not finish within {timeout_s:g} s") from None
        finally:
            channel.close()
        return line, code, out, b"".join(errors)

    def read_file(self, path: str) -> str | None:
        sftp = self._sftp_client()
        if sftp is None:
            _line, code, out, err = self._exec(["cat", "--", path], None, 60.0)
            if code != 0 and b"No such file" in err:
                return None
            if code != 0:
                raise HostError(self.label, f"cannot read {path}: {err.decode(errors='replace').strip()[:200]}")
            return out.decode()
        try:
            with sftp.open(path, "r") as handle:
                return handle.read().decode()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(self.label, f"cannot read {path}: {exc}") from None

    def read_bytes(self, path: str) -> bytes:
        sftp = self._sftp_client()
        if sftp is None:
            _line, code, out, err = self._exec(["cat", "--", path], None, 600.0)
            if code != 0:
                raise HostError(self.label, f"cannot read {path}: {err.decode(errors='replace').strip()[:200]}")
            return out
        buffer = io.BytesIO()
        try:
            sftp.getfo(path, buffer)
        except OSError as exc:
            raise HostError(self.label, f"cannot read {path}: {exc}") from None
        return buffer.getvalue()

    def write_file(self, path: str, data: bytes) -> None:
        sftp = self._sftp_client()
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        if sftp is None:  # the same steps over an exec channel: private, then renamed into place
            script = 'umask 077 && cat > "$1" && mv -f -- "$1" "$2"'
            _line, code, _out, err = self._exec(["sh", "-c", script, "sh", tmp, path], data, 600.0)
            if code != 0:
                raise HostError(self.label, f"cannot write {path}: {err.decode(errors='replace').strip()[:200]}")
            return
        try:
            with sftp.open(tmp, "wb") as handle:
                handle.set_pipelined(True)
                handle.chmod(0o600)
                handle.write(data)
            sftp.posix_rename(tmp, path)
        except OSError as exc:
            raise HostError(self.label, f"cannot write {path}: {exc}") from None

    def open_stream(self, port: int) -> Stream:
        transport = self._transport()
        try:
            channel = transport.open_channel("direct-tcpip", ("127.0.0.1", port), ("127.0.0.1", 0),
                                             timeout=self.host.ssh.connect_timeout_s)
        except paramiko.ChannelException as exc:
            raise HostError(self.label, f"no worker server answers on the host's 127.0.0.1:{port} ({exc.text})") from None
        except paramiko.SSHException as exc:
            raise HostError(self.label, f"cannot open a channel to port {port}: {exc}") from None
        channel.settimeout(60.0)
        return channel

    def _sftp_client(self) -> paramiko.SFTPClient | None:
        """SFTP, or None where the host's sshd has no sftp subsystem (files then go over exec channels).

        Such an sshd accepts the channel and closes it at the subsystem request, which
        paramiko reports as a bare "Channel closed." (it was an internal error once).
        """
        if self._sftp is None and not self._no_sftp:
            transport = self._transport()

            def open_once() -> paramiko.SFTPClient | None:
                try:
                    return paramiko.SFTPClient.from_transport(transport)
                except paramiko.ChannelException as exc:
                    raise _Throttled(str(exc)) from None
                except (paramiko.SSHException, EOFError):
                    if not transport.is_active():
                        raise HostError(self.label, "the SSH connection closed while opening SFTP") from None
                    return None

            self._sftp = _retry(open_once, self.label, "open SFTP")
            self._no_sftp = self._sftp is None
        return self._sftp

    def close(self) -> None:
        with self._lock:
            if self._sftp is not None:
                self._sftp.close()
                self._sftp = None
            if self._client is not None:
                self._client.close()
                self._client = None


class _ChannelStream:
    """An exec channel as a byte stream; at its end a failed command's last stderr line is raised."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel

    def sendall(self, data: bytes, /) -> None:
        self._channel.sendall(data)

    def recv(self, size: int, /) -> bytes:
        data = self._channel.recv(size)
        if not data and self._channel.status_event.wait(2.0) and self._channel.recv_exit_status() != 0:
            err = b""
            while self._channel.recv_stderr_ready():
                err += self._channel.recv_stderr(4096)
            raise ConnectionError(last_line(err) or f"exit code {self._channel.recv_exit_status()}")
        return data

    def settimeout(self, timeout: float | None, /) -> None:
        self._channel.settimeout(timeout)

    def close(self) -> None:
        self._channel.close()


def _retry(attempt: Callable[[], T], label: str, what: str, error: type[HostError] = HostError) -> T:
    wait_s = THROTTLE_FIRST_WAIT_S
    for number in range(1, THROTTLE_ATTEMPTS + 1):
        try:
            return attempt()
        except _Throttled as exc:
            if number == THROTTLE_ATTEMPTS:
                raise error(label, f"could not {what} after {THROTTLE_ATTEMPTS} attempts: sshd keeps refusing "
                                       f"({exc}); check its MaxStartups/MaxSessions") from None
            time.sleep(wait_s)
            wait_s = min(wait_s * 2, THROTTLE_MAX_WAIT_S)
    raise AssertionError("unreachable")
