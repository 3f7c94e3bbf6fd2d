"""Run on a host before ``_env_host.py`` (the same ``python -c`` script): what a build removes after it.

Its source comes first in ``host_script()``; the client imports it as a module only for
``_env_host``'s names. Standard library only, for the same reason as ``_env_host``.

After a build, environments past the newest ``keep`` (by last use: ``check`` touches
``.last-used`` of a ready one) are removed, but never one in use: one a process runs
(its path in the process's command line: a server, its warm interpreter, a cold rank; or
in a server's ``interpreter`` file under the workdir, for hosts sharing it over NFS), or
one a job's lease names (``.in-use/<job>.<folder hash>``, written here for a job's ``--requirements``
layer) while that job's folder on the server has no ``result.json`` (ranks forked from a
warm interpreter show nothing of their layer in /proc). Without /proc nothing is removed.

A ``wheels-<hash>`` folder goes when no remaining environment was built from it (the ready
marker names its folder), it is older than ``WHEELS_UNUSED_S`` (a client may have just sent
it and not yet built: a build holds the folder's lock from then on), and no build holds its
lock. A marker from before that record keeps every folder.
"""

import fcntl
import json
import os
import shutil
import time

MARKER = ".distrun-ready"
LAST_USED = ".last-used"
LEASES = ".in-use"
#: A lease whose job never reached the server (refused before its submit) is void after this.
LEASE_UNSUBMITTED_S = 600
#: A wheels folder no environment was built from stays this long: a client may have just sent it
#: and be about to build from it (its build then holds the folder's lock).
WHEELS_UNUSED_S = 3600


def _last_used(env_dir):
    times = []
    for name in (LAST_USED, MARKER):
        try:
            times.append(os.stat(os.path.join(env_dir, name)).st_mtime)
        except OSError:
            pass
    return max(times) if times else 0.0


def _command_lines():
    """Every process's command line this user may read, or None where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open("/proc/%s/cmdline" % pid, "rb") as source:
                    lines.append(source.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return lines


def _servers_interpreters(workdir):
    """The interpreters `up` started servers with, from every host's state folder under ``workdir``
    (``<cluster>/<host>/interpreter``): on a home folder shared over NFS, other hosts' servers use
    these environments too, and their processes are not in this host's /proc."""
    found = []
    for cluster in _listdir(workdir):
        if cluster.startswith("."):  # .envs: a cluster's name never starts with a dot
            continue
        for host in _listdir(os.path.join(workdir, cluster)):
            try:
                with open(os.path.join(workdir, cluster, host, "interpreter")) as source:
                    found.append(source.read().strip())
            except OSError:
                continue
    return found


def _leased(env_dir):
    """Whether a job that may still run holds a lease on ``env_dir``."""
    folder = os.path.join(env_dir, LEASES)
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    for name in names:
        if name.startswith("."):  # a lease being written (``_write_lease``): its job's own check holds the layer
            continue
        try:
            with open(os.path.join(folder, name)) as source:
                lease = json.load(source)
            job_dir, at = str(lease["folder"]), float(lease["at"])
        except (OSError, ValueError, KeyError, TypeError):
            return True  # unreadable: assume in use
        attempts = [path for path in (job_dir, *(os.path.join(os.path.dirname(job_dir), n) for n in
                    _listdir(os.path.dirname(job_dir)) if n.startswith(os.path.basename(job_dir) + "-r")))
                    if os.path.isdir(path)]
        if not attempts and time.time() - at < LEASE_UNSUBMITTED_S:
            return True
        if any(not os.path.exists(os.path.join(path, "result.json")) for path in attempts):
            return True
    return False


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def collect_old(root, keep, current):
    """Remove ready environments past the newest ``keep`` by last use, never ``current`` or one in use;
    then the wheels folders none of those left was built from. The names of what went."""
    envs = []
    for name in _listdir(root):
        path = os.path.join(root, name)
        if not name.startswith("wheels-") and os.path.isfile(os.path.join(path, MARKER)):
            envs.append((_last_used(path), path))
    envs.sort(reverse=True)
    old = [path for _, path in envs[max(1, int(keep)):] if path != current]
    if not old:
        return _collect_wheels(root, current)
    running = _command_lines()
    if running is None:
        return []
    running += _servers_interpreters(os.path.dirname(root))
    removed = []
    for path in old:
        if any(path + os.sep in line for line in running) or _leased(path):
            continue
        with open(path + ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not while another `up` builds or checks it
            except OSError:
                continue
            os.remove(os.path.join(path, MARKER))  # first: a half-removed environment is never taken as ready
            shutil.rmtree(path, ignore_errors=True)
        removed.append(os.path.basename(path))
    return removed + _collect_wheels(root, current)


def _collect_wheels(root, current):
    """Remove the ``wheels-*`` folders no remaining environment was built from (its marker's
    ``wheels``), past an hour old, that no build holds (their lock, taken without waiting).
    An environment whose marker predates that record keeps every folder: it may use any."""
    kept = set()
    for name in _listdir(root):
        try:
            with open(os.path.join(root, name, MARKER)) as source:
                marker = json.load(source)
        except (OSError, ValueError):
            continue
        if not isinstance(marker, dict) or "wheels" not in marker:
            return []
        kept.add(marker["wheels"])
    kept.add(_answer_wheels(current))
    removed = []
    for name in sorted(_listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith("wheels-") or name.endswith(".lock") or path in kept or not os.path.isdir(path):
            continue
        try:
            age_s = time.time() - max(os.stat(path).st_mtime, os.stat(os.path.join(path, ".complete")).st_mtime)
        except OSError:
            age_s = time.time() - os.stat(path).st_mtime  # not whole: a send that died (or is under way)
        if age_s < WHEELS_UNUSED_S:
            continue
        with open(path + ".lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def _answer_wheels(env_dir):
    """The wheels folder the environment at ``env_dir`` was built from (its marker's), or None."""
    try:
        with open(os.path.join(env_dir, MARKER)) as source:
            return json.load(source).get("wheels")
    except (OSError, ValueError, AttributeError):
        return None
