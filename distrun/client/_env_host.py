"""Run on a host by the host's own ``python -c``: find or build the environment `up` asked for.

This file is sent as source, not imported there: the host's interpreter may not have
distrun at all (distrun itself may be what the environment brings), so it uses the
standard library only and imports nothing of distrun's. It reads one JSON object on
stdin and prints one JSON object on stdout::

    python -c SOURCE check|build   < {"root", "version", "wanted", "requirements", "index", "complete",
                                      "keep", "lease", "variants": {"plain"|"with_distrun": {"spec", "wheels"}}}
    python -c SOURCE inspect       < {"modules": [...], "path": [...]}

``check`` says which interpreter the server should run and whether its environment is
ready; ``build`` makes it ready. ``inspect`` (before a job, ``client/_skew``) says what the
ranks would import, without importing it: this Python's version, whether each module is
found and the version of the distribution that holds it, torch's version and whether it
was built with CUDA (read from ``torch/version.py``: importing torch takes seconds).

An environment is a virtualenv ``root/<name>`` layered on this interpreter: ``--system-site-packages``, and when this interpreter is itself a
virtualenv, a ``.pth`` that adds its site folders too (a venv made from a venv is
layered on the base interpreter only), so torch and CUDA installed here are used, not
downloaded again. Its name hashes the client's spec (requirements and wheels' sha256s)
with this interpreter's version, prefix and platform: a changed ``python:`` is another
environment. The ready marker is written last, after pip succeeded; a failed build is
removed, so the next `up` starts clean and the cluster is left as it was. A lock per
name makes two hosts sharing a home folder (NFS) build it once.

After a build, environments past the newest ``keep`` (by last use: ``check`` touches
``.last-used`` of a ready one) are removed, but never one in use: one a process runs
(its path in the process's command line: a server, its warm interpreter, a cold rank; or
in a server's ``interpreter`` file under the workdir, for hosts sharing it over NFS), or
one a job's lease names (``.in-use/<job>``, written here for a job's ``--requirements``
layer) while that job's folder on the server has no ``result.json`` (ranks forked from a
warm interpreter show nothing of their layer in /proc). Without /proc nothing is removed.
"""

import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time

MARKER = ".distrun-ready"
PIP_TIMEOUT_S = 1800
LAST_USED = ".last-used"
LEASES = ".in-use"
#: A lease whose job never reached the server (refused before its submit) is void after this.
LEASE_UNSUBMITTED_S = 600


def _distrun_version():
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:
        return None
    try:
        return version("distrun")
    except PackageNotFoundError:
        return None


def _name(spec):
    ident = "\n".join([spec, sys.version, os.path.abspath(sys.executable), sys.prefix, platform.machine(),
                       sysconfig.get_platform()])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _absolute(path):
    return os.path.abspath(os.path.expanduser(path)) if path else None


def _answer(config):
    """What ``check`` prints: this interpreter as is (``python`` null), or the environment to run."""
    base = _distrun_version()
    needs = base != config["version"]
    said = {"python": None, "base_distrun": base, "base_version": sys.version.split()[0]}
    if not needs and not config["wanted"]:
        return said
    variant = config["variants"]["with_distrun" if needs else "plain"]
    name = _name(variant["spec"])
    env_dir = os.path.join(_absolute(config["root"]), name)
    wheels = _absolute(variant["wheels"])
    site_dir = os.path.join(env_dir, "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
    said.update(python=os.path.join(env_dir, "bin", "python"), name=name, needs_distrun=needs, dir=env_dir,
                site=site_dir,
                ready=os.path.exists(os.path.join(env_dir, MARKER)), wheels=wheels,
                wheels_ready=wheels is None or os.path.exists(os.path.join(wheels, config["complete"])))
    return said


def _sees_system_site():
    """Whether this interpreter sees the base interpreter's packages (a venv may not): the layer keeps that."""
    if sys.prefix == sys.base_prefix:
        return True
    try:
        with open(os.path.join(sys.prefix, "pyvenv.cfg")) as cfg:
            for line in cfg:
                key, _, value = line.partition("=")
                if key.strip() == "include-system-site-packages":
                    return value.strip().lower() == "true"
    except OSError:
        pass
    return False


def _parent_site_pth(env_dir):
    """A .pth adding this interpreter's own site folders, when it is a venv (else a no-op)."""
    if sys.prefix == sys.base_prefix:
        return
    purelib = sysconfig.get_path("purelib", vars={"base": env_dir, "platbase": env_dir})
    lines = ["import site; site.addsitedir(%r)" % path for path in site.getsitepackages() if os.path.isdir(path)]
    with open(os.path.join(purelib, "_distrun_parent.pth"), "w") as out:
        out.write("\n".join(lines) + "\n")


def _last_error(log):
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors[-1] if errors else (lines[-1] if lines else "pip printed nothing"))[:400]


def _requirement_of(line, requirements):
    for requirement in requirements:
        if requirement and requirement in line:
            return requirement
    marker = " for "
    return line.rsplit(marker, 1)[1].strip() if marker in line else ""


def _build(config, answer):
    env_dir = answer["dir"]
    os.makedirs(os.path.dirname(env_dir), mode=0o700, exist_ok=True)
    with open(env_dir + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another host on the same home folder builds it once
        if os.path.exists(os.path.join(env_dir, MARKER)):
            return dict(answer, ready=True, installed=False)
        shutil.rmtree(env_dir, ignore_errors=True)  # a build that died half-way
        import venv

        venv.EnvBuilder(system_site_packages=_sees_system_site(), with_pip=False, symlinks=True).create(env_dir)
        _parent_site_pth(env_dir)
        requirements = list(config["requirements"])
        if answer["needs_distrun"]:
            requirements.append("distrun==" + config["version"])
        with open(os.path.join(env_dir, "requirements.txt"), "w") as out:
            out.write("\n".join(requirements) + "\n")
        argv = [answer["python"], "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
                "--no-warn-script-location", "-r", os.path.join(env_dir, "requirements.txt")]
        if config["index"] is False:
            argv.append("--no-index")
        elif isinstance(config["index"], str):
            argv += ["--index-url", config["index"]]
        if answer["wheels"]:
            argv += ["--find-links", answer["wheels"]]
        env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, timeout=PIP_TIMEOUT_S)
        log = done.stdout.decode(errors="replace")
        if done.returncode != 0:
            shutil.rmtree(env_dir, ignore_errors=True)
            line = _last_error(log)
            if "No module named pip" in log:
                line = ("%s has no pip to install %s with (`%s -m ensurepip`, or the python3-pip package)"
                        % (sys.executable, ", ".join(requirements), sys.executable))
            return {"error": line, "requirement": _requirement_of(line, requirements), "log": log[-4000:]}
        with open(os.path.join(env_dir, "install.log"), "w") as out:
            out.write(log)
        with open(os.path.join(env_dir, MARKER), "w") as out:  # last: the environment is whole
            json.dump({"name": answer["name"], "requirements": requirements, "built_at": time.time()}, out)
    return dict(answer, ready=True, installed=True)


def _version_of(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except Exception:  # noqa: BLE001 - a broken dist-info says nothing: no version, no verdict
        return None


def _torch_cuda(spec):
    """torch's CUDA version as its build wrote it in torch/version.py ('' when built without), None if unreadable."""
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as source:
            text = source.read()
    except (OSError, TypeError):
        return None
    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*(.+)$", text, re.MULTILINE)
    if not found:
        return None
    value = found.group(1).strip().strip("'\"")
    return "" if value in ("None", "") else value


def inspect_modules(modules):
    """What importing ``modules`` here would find (nothing is imported): the caller's sys.path."""
    import importlib.util
    from importlib import metadata

    owners = None  # every distribution's top-level names: a scan of them all, only when a name needs it
    found = {}
    for name in list(modules) + ["torch"]:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        dists = [name] if spec is not None and _version_of(name) else []
        if spec is not None and not dists:
            if owners is None:
                try:
                    owners = metadata.packages_distributions()
                except Exception:  # noqa: BLE001 - one broken dist-info must not hide the others' answers
                    owners = {}
            dists = owners.get(name) or []
        found[name] = {"found": spec is not None, "dist": dists[0] if dists else None,
                       "version": _version_of(dists[0]) if dists and spec is not None else None}
        if name == "torch" and spec is not None:
            found[name]["cuda"] = _torch_cuda(spec)
    return {"python": "%d.%d" % sys.version_info[:2], "python_full": platform.python_version(), "modules": found}


def _inspect(config):
    """As the ranks import: the job's own layer first (``path``), never this login folder."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", cwd)]
    sys.path[:0] = [p for p in config.get("path") or [] if isinstance(p, str)]
    return inspect_modules([m for m in config.get("modules") or [] if isinstance(m, str)])


def _mark_used(config, answer):
    """A ready environment was chosen: its last use is now, and a job's lease says who uses it."""
    env_dir = answer["dir"]
    try:
        with open(os.path.join(env_dir, LAST_USED), "w"):
            pass
        lease = config.get("lease")
        if lease:
            os.makedirs(os.path.join(env_dir, LEASES), mode=0o700, exist_ok=True)
            name = os.path.basename(str(lease["job"])) or "job"
            with open(os.path.join(env_dir, LEASES, name), "w") as out:
                json.dump({"folder": _absolute(str(lease["folder"])), "at": time.time()}, out)
    except OSError:
        pass  # a read-only environment is still usable; it is only never removed


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


def _collect(root, keep, current):
    """Remove ready environments past the newest ``keep`` by last use; never ``current`` or one in use."""
    envs = []
    for name in _listdir(root):
        path = os.path.join(root, name)
        if not name.startswith("wheels-") and os.path.isfile(os.path.join(path, MARKER)):
            envs.append((_last_used(path), path))
    envs.sort(reverse=True)
    old = [path for _, path in envs[max(1, int(keep)):] if path != current]
    if not old:
        return []
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
    return removed


def main():
    config = json.loads(sys.stdin.read())
    if sys.argv[1] == "inspect":
        print(json.dumps(_inspect(config)))
        return 0
    answer = _answer(config)
    if sys.argv[1] == "build" and answer["python"] is not None:
        answer = _build(config, answer)
        if answer.get("installed"):
            try:
                answer["removed"] = _collect(_absolute(config["root"]), config.get("keep", 5), answer["dir"])
            except OSError:
                answer["removed"] = []  # an old environment that stays is no reason to fail a build that worked
    if answer.get("python") is not None and answer.get("ready"):
        _mark_used(config, answer)
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
