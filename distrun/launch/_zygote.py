"""The warm interpreter: imports torch once, then forks training processes on request.

``python -u -m distrun.launch._zygote SOCKET [--preload MODULE ...]`` imports
the preload modules (by name: this package never imports torch itself),
listens on a unix socket (0600, in the server's private folder), and for each
request forks a child that becomes ``python -m distrun.runtime`` with the
request's environment, folder and file descriptors (received with
SCM_RIGHTS). Interpreter start-up and the torch import, most of a cold start,
are paid once per server instead of once per rank and job.

Safety of fork: the zygote is single-threaded (one selector loop, children
reaped with WNOHANG), imports torch without touching CUDA, and children reset
signal handlers and start a new session. It asks the kernel to kill it when the
worker server dies, and children ask the same of the zygote, so nothing outlives
the server.

Each request's connection stays open: the zygote writes ``{"pid": N}`` when the
child starts and ``{"exit": code}`` (negative: killed by that signal) when it ends.
A connection that closes before its child has ended means the launcher that
asked for it is gone (a SIGKILLed ``distrun train`` on a warm local run): the
zygote kills the child's process group, so a dead launcher leaves no orphans,
as PR_SET_PDEATHSIG guarantees for a cold start.

Only processes of the zygote's own user may connect (SO_PEERCRED), on top of
the socket's 0600 mode in a 0700 folder.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1
_MAX_REQUEST_BYTES = 1 << 20
_MAX_FDS = 16
_ALLOWED_MODULE = "distrun.runtime"
#: What a training process would import anyway. torch._dynamo alone is over a second:
#: DDP and the optimizers pull it in on first use. torchmetrics (distrun's evaluation, and
#: most recipes' metrics) is another second; on the H100 machine a warm fit recipe with
#: metrics reached its first step in 4.7 s without it.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.optim", "torch.utils.data",
           "distrun.runtime._main", "distrun.runtime._fit", "distrun.runtime._metrics", "distrun.strategies",
           # What a cold rank imports only when its job asks (FSDP2, DTensor, pipelining, DCP: 1.2 s):
           # the warm interpreter pays it once, so a sharded or model-parallel job starts warm too.
           "distrun.strategies.sharded", "distrun.strategies.model_parallel",
           "distrun.strategies.checkpoint.shard_reader")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distrun.launch._zygote")
    parser.add_argument("socket_path")
    parser.add_argument("--preload", nargs="*", default=list(PRELOAD))
    parser.add_argument("--parent", type=int, default=None, help="exit if this pid is not our parent")
    args = parser.parse_args(argv)
    # On Slurm a warning (SIGUSR1) goes to every process of the server's step: the zygote lives
    # on, and what it forks keeps ignoring it until the rank sets its own handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _die_with_parent()
    if args.parent is not None and os.getppid() != args.parent:
        return 1
    for module in args.preload:
        importlib.import_module(module)
    old_umask = os.umask(0o077)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.unlink(args.socket_path)
    except FileNotFoundError:
        pass
    listener.bind(args.socket_path)
    os.umask(old_umask)
    listener.listen(64)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    return _serve(listener)


def _serve(listener: socket.socket) -> int:
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(0.05):
            if key.fileobj is listener:
                _accept(listener, selector, children)
            else:
                _launcher_spoke(key.fileobj, key.data, selector, children)  # type: ignore[arg-type]
        while True:  # every child, also one killed after its launcher left (no longer in `children`)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                selector.unregister(conn)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _send(conn, {"exit": code})
                conn.close()


def _accept(listener: socket.socket, selector: selectors.BaseSelector, children: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    try:
        _check_peer(conn)
        pid = _fork_child(conn, listener)
    except Exception as exc:  # a bad request must not take the zygote down
        _send(conn, {"error": str(exc)})
        conn.close()
        return
    children[pid] = conn
    _send(conn, {"pid": pid})
    conn.setblocking(False)
    selector.register(conn, selectors.EVENT_READ, pid)


def _check_peer(conn: socket.socket) -> None:
    """Refuse a process of another user (the socket's mode already should)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        raise PermissionError(f"uid {uid} may not use this zygote")


def _launcher_spoke(conn: socket.socket, pid: int, selector: selectors.BaseSelector,
                    children: dict[int, socket.socket]) -> None:
    """The launcher never writes after its request, so readable means it closed: it is gone."""
    try:
        data = conn.recv(4096)
    except BlockingIOError:
        return
    except OSError:
        data = b""
    if data:
        return
    selector.unregister(conn)
    conn.close()
    if children.pop(pid, None) is not None:
        _kill_group(pid)  # reaped by the loop in _serve; nobody is left to tell


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session (setsid)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)  # not yet past setsid
        except OSError:
            pass


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the launcher went away; its training processes are killed by it or with it


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(10.0)
    fds: list[int] = []
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        msg, ancdata, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(_MAX_FDS * 4))
        if not msg:
            raise ConnectionError("request cut short")
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(int.from_bytes(payload[i:i + 4], sys.byteorder) for i in range(0, len(payload), 4))
        if len(data) >= 4 and int.from_bytes(data[:4], "big") > _MAX_REQUEST_BYTES:
            raise ValueError("request too large")
    return json.loads(data[4:4 + int.from_bytes(data[:4], "big")].decode()), fds


def _fork_child(conn: socket.socket, listener: socket.socket) -> int:
    request, fds = _receive(conn)
    argv, targets = request["argv"], request["targets"]
    if argv[1:3] != ["-m", _ALLOWED_MODULE] or len(fds) != len(targets):
        for fd in fds:
            os.close(fd)
        raise ValueError(f"the zygote only starts `-m {_ALLOWED_MODULE}`")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    try:  # the child: never returns
        _become_training_process(request, fds, targets)
    except BaseException:  # noqa: BLE001 - report and leave, whatever happened
        import traceback

        traceback.print_exc()
        os._exit(70)
    os._exit(0)


def _become_training_process(request: dict[str, Any], fds: list[int], targets: list[int]) -> None:
    # The dispositions a fresh interpreter starts with: Python ignores SIGPIPE (a write to a
    # closed pipe raises BrokenPipeError) and turns SIGINT into KeyboardInterrupt.
    fresh = {signal.SIGPIPE: signal.SIG_IGN, signal.SIGINT: signal.default_int_handler}
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, fresh.get(signum, signal.SIG_DFL))
    os.setsid()
    # Move received fds above every target first, so no target overwrites a source (a plain
    # dup takes the lowest free number, which may be a target still to be filled).
    floor = max([*targets, 2]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for source, target in zip(high, targets):
        os.dup2(source, target)  # inheritable, as Popen's pass_fds would leave them
    keep = set(targets) | {0, 1, 2}
    # Every other fd goes: the listener, the selector, other children's connections.
    for fd in sorted({int(name) for name in os.listdir("/proc/self/fd")} - keep):
        try:
            os.close(fd)
        except OSError:
            pass
    if request.get("cwd"):
        os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _match_fresh_sys_path()
    _die_with_parent()  # the runtime sets it again; this covers the gap until then
    sys.argv = [request["argv"][0], *request["argv"][3:]]
    runpy.run_module(_ALLOWED_MODULE, run_name="__main__", alter_sys=True)


def _match_fresh_sys_path() -> None:
    """Make sys.path what ``python -m`` would build here and now: the working folder
    first, then the request's PYTHONPATH (the zygote read its own at start-up)."""
    fresh = [os.getcwd(), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    sys.path[:] = [*fresh, *(p for p in sys.path[1:] if p not in fresh)]


if __name__ == "__main__":
    sys.exit(main())
