"""``python -m distrun.server``: start a worker server (detached) or sweep a host.

``start --state-dir DIR`` reads its configuration as one JSON object on stdin
(``{"env": {...}}``; stdin, not argv, so values such as secrets never show in
``ps``), starts the server in a session of its own so it outlives the SSH session
that started it, waits until the server has bound its port and written its
state file, prints ``{"pid": ..., "port": ...}`` and exits 0. If the server
cannot start, the reason is printed on stderr and the exit code is 1; 3 means a
server already holds the folder's lock.

``start --attach`` is for a Slurm step: the same configuration on stdin, but the
server replaces this process instead of detaching (a step's processes end with
the step, so the server must be the step), its log goes to the state folder, and
the ready message (``{"pid": ..., "port": ...}`` or ``{"error": ...}``) is the
one line it prints on stdout.

``serve`` is that server process itself (``--foreground`` debugging runs it
directly). The cluster's env and the ``DISTRUN_SERVER_DIR`` marker are given to
it at exec time, so they are in its ``/proc/<pid>/environ`` and inherited by
every training process it starts.

``sweep --state-dir DIR [--kill]`` prints the processes of this host's server
still alive (and ends them with ``--kill``), so `down` checks rather than assumes.

``history --state-dir DIR`` prints the newest finished jobs' record files and their sizes
(``{"jobs": [{"job": ..., "files": {"events.ndjson": bytes, ...}, "ended_at": ...}]}``), read
from the folder alone, with or without a server; ``history --pack JOB ...`` writes those jobs'
files to stdout as one tar: `distrun down` keeps them in the client's history.

``relay --port P`` joins stdin and stdout to the server on loopback port P: the
client's stream to a Slurm node's server rides on an srun step running it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from typing import Any

EXIT_LOCKED = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distrun.server")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a detached worker server (config JSON on stdin)")
    start.add_argument("--state-dir", required=True)
    start.add_argument("--attach", action="store_true", help="become the server (a Slurm step) instead of detaching")
    serve = sub.add_parser("serve", help="the server process itself (started by `start`)")
    serve.add_argument("--state-dir", required=True)
    serve.add_argument("--config-sha256", default="")
    serve.add_argument("--ready-fd", type=int, default=None)
    sweep_cmd = sub.add_parser("sweep", help="list (and with --kill, end) this server's processes")
    sweep_cmd.add_argument("--state-dir", required=True)
    sweep_cmd.add_argument("--kill", action="store_true")
    history_cmd = sub.add_parser("history", help="list the finished jobs' record files, for the client's history")
    history_cmd.add_argument("--state-dir", required=True)
    history_cmd.add_argument("--pack", nargs="+", metavar="JOB", help="write these jobs' files to stdout as a tar")
    history_cmd.add_argument("--max-events-bytes", type=int, default=None)
    history_cmd.add_argument("--max-bytes", type=int, default=None)
    relay_cmd = sub.add_parser("relay", help="join stdin/stdout to this host's server on a loopback port")
    relay_cmd.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command == "relay":
        from distrun.server._relay import relay

        return relay(args.port)
    if args.command == "sweep":
        from distrun.server._sweep import sweep

        print(json.dumps(sweep(args.state_dir, kill=args.kill)))
        return 0
    if args.command == "history":
        from pathlib import Path

        from distrun.server._job_record import PACK_MAX_BYTES, PACK_MAX_EVENTS_BYTES, job_files, pack_jobs

        jobs_dir = Path(args.state_dir).expanduser() / "jobs"
        if args.pack:
            pack_jobs(jobs_dir, args.pack, sys.stdout.buffer,
                      max_events_bytes=args.max_events_bytes or PACK_MAX_EVENTS_BYTES,
                      max_bytes=args.max_bytes or PACK_MAX_BYTES)
            return 0
        print(json.dumps({"jobs": job_files(jobs_dir)}))
        return 0
    if args.command == "serve":
        from distrun.server._state import StateDir

        return _serve(StateDir(args.state_dir), args.config_sha256, ready_fd=args.ready_fd)
    try:
        config = json.loads(sys.stdin.read() or "{}")
        env = config.get("env", {}) if isinstance(config, dict) else None
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError('expected {"env": {name: value}}')
    except (ValueError, RecursionError) as exc:
        print(f"bad server configuration on stdin: {exc}", file=sys.stderr)
        return 2
    if args.attach:
        return _attach(args.state_dir, config)
    return _start(args.state_dir, config)


#: A Slurm step's own variables, which the server's step carries and must not hand on to the
#: ranks it starts: a framework that reads them (Lightning's SLURMEnvironment) would take the
#: one-task server step for the job. The allocation's (SLURM_JOB_ID, the node list) stay.
_STEP_VARS = ("SLURM_STEP", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
              "SLURM_TASK", "SLURM_SRUN", "SLURM_CPU_BIND", "SLURM_DISTRIBUTION", "SLURM_LAUNCH", "SLURM_GTIDS",
              "SLURM_UMASK", "SLURM_PRIO_PROCESS", "SLURM_SUBMIT", "SLURM_TASKS_PER_NODE", "SLURM_NNODES",
              "SLURM_JOB_NUM_NODES", "SLURM_CPUS_PER_TASK", "SLURM_OVERLAP", "SLURM_WHOLE", "SLURM_JOB_NAME")


def _server_env(state_dir: Any, config: dict[str, Any], *, scrub_step: bool) -> dict[str, str]:
    from distrun.server._sweep import SERVER_DIR_ENV

    base = {key: value for key, value in os.environ.items()
            if not (scrub_step and key.startswith(_STEP_VARS))}
    return {**base, **config.get("env", {}), SERVER_DIR_ENV: str(state_dir.path)}


def _open_state(state_dir_path: str) -> tuple[Any, int] | str:
    """The state folder, created, and its log opened for appending; or why not."""
    from distrun.server._state import StateDir

    state_dir = StateDir(state_dir_path)
    try:
        state_dir.create()
        return state_dir, os.open(state_dir.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        return f"cannot create {state_dir.path}: {exc}"


def _attach(state_dir_path: str, config: dict[str, Any]) -> int:
    """Become the server: its stderr (the log) to the state folder, the ready line to stdout."""
    from distrun.protocol.cluster import config_digest

    opened = _open_state(state_dir_path)
    if isinstance(opened, str):
        print(json.dumps({"error": opened}), flush=True)
        return 1
    state_dir, log_fd = opened
    sys.stdout.flush()
    os.dup2(log_fd, 2)
    os.close(log_fd)
    env = _server_env(state_dir, config, scrub_step=True)
    os.execve(sys.executable, [sys.executable, "-m", "distrun.server", "serve", "--state-dir", str(state_dir.path),
                               "--config-sha256", config_digest(config), "--ready-fd", "1"], env)


def _start(state_dir_path: str, config: dict[str, Any]) -> int:
    from distrun.protocol.cluster import config_digest

    opened = _open_state(state_dir_path)
    if isinstance(opened, str):
        print(opened, file=sys.stderr)
        return 1
    state_dir, log_fd = opened
    env = _server_env(state_dir, config, scrub_step=False)
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "distrun.server", "serve", "--state-dir", str(state_dir.path),
            "--config-sha256", config_digest(config), "--ready-fd", str(write_fd)]
    try:
        subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                         start_new_session=True, pass_fds=(write_fd,), close_fds=True)
    finally:
        os.close(write_fd)
        os.close(log_fd)
    with os.fdopen(read_fd, "rb") as ready:
        answer = ready.read()  # EOF when the server is ready, or when it died
    try:
        outcome = json.loads(answer.decode() or "{}")
    except ValueError:
        outcome = {}
    if "port" in outcome:
        print(json.dumps(outcome))
        return 0
    print(outcome.get("error", f"the worker server exited before it was ready; see {state_dir.log_file}"),
          file=sys.stderr)
    return int(outcome.get("code", 1))


def _serve(state_dir: Any, digest: str, *, ready_fd: int | None) -> int:
    from distrun.server._server import WorkerServer

    def ready(message: dict[str, Any]) -> None:
        if ready_fd is not None:
            os.write(ready_fd, json.dumps(message).encode() + (b"\n" if ready_fd == 1 else b""))
            if ready_fd == 1:  # attached (a Slurm step): stdout stays open, on /dev/null
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            else:
                os.close(ready_fd)
        elif "error" in message:
            print(message["error"], file=sys.stderr)

    os.umask(0o077)
    state_dir.create()
    lock_fd = state_dir.lock()
    if lock_fd is None:
        held = state_dir.read()
        who = f" (pid {held.pid})" if held else ""
        ready({"error": f"a worker server already runs for {state_dir.path}{who}", "code": EXIT_LOCKED})
        return EXIT_LOCKED
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        server = WorkerServer(state_dir, config_sha256=digest)
        port = server.bind()
        state_dir.write(server.state())
    except Exception as exc:  # report any start failure to the waiting launcher
        ready({"error": f"worker server failed to start: {type(exc).__name__}: {exc}"})
        return 1
    ready({"pid": os.getpid(), "port": port})
    server.serve_forever()
    return 0
