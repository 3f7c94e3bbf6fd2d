"""Run on a host by the host's own ``python -c``: find or build the environment `up` asked for.

This file is sent as source, not imported there: the host's interpreter may not have
distrun at all (distrun itself may be what the environment brings), so it uses the
standard library only and imports nothing of distrun's. It reads one JSON object on
stdin and prints one JSON object on stdout::

    python -c SOURCE check|build   < {"root", "version", "wanted", "requirements", "index", "complete",
                                      "keep", "lease", "installer",
                                      "variants": {"plain"|"with_distrun": {"spec", "wheels"}}}
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
environment. It is installed with uv where this host has it (on PATH, beside this
python, or this python's ``uv`` package; ``installer:`` may ask for one), else with pip,
with the same requirements, wheels folder and index; uv sees the base's packages through
metadata-only copies while it runs (``_shadow_base``). The marker records which installer
built it. The ready marker is written last, after the installer succeeded; a failed build is
removed, so the next `up` starts clean and the cluster is left as it was. A lock per
name makes two hosts sharing a home folder (NFS) build it once.

After a build, old environments and wheels folders go (``_env_collect.py``, whose source
``host_script()`` sends before this one: a host may have no distrun to import it from).
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

if __name__ != "__main__":  # imported on the client (client/_skew); on a host, host_script() put this source first
    from distrun.client._env_collect import LAST_USED, LEASES, MARKER, collect_old

PIP_TIMEOUT_S = 1800
#: The INSTALLER of a base distribution's metadata copy, shown to uv while it installs (``_shadow_base``).
SHADOW = "distrun-base-metadata"


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


def _last_uv_error(log):
    """uv's verdict in one line: its last ``error:`` (older uv: ``×``) line, with the cause after it
    (``cause:``, ``Caused by:``, older uv's ``╰─▶``, and their wrapped lines), hints left out."""
    marks = ("error:", "×", "cause:", "caused by:", "╰─▶", "hint:", "help:")
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.lower().startswith(("error:", "×"))]
    if not starts:
        return ("uv: " + (lines[-1] if lines else "uv printed nothing"))[:400]

    def text(line):
        for mark in marks:
            if line.lower().startswith(mark):
                return line[len(mark):].strip()
        return line

    head, cause = text(lines[starts[-1]]).rstrip(":"), []
    for line in lines[starts[-1] + 1:]:
        if line.lower().startswith(("hint:", "help:", "error:", "×")) or (cause and line.lower().startswith(marks)):
            break
        cause.append(text(line))
    return ("uv: " + head + (": " + " ".join(cause) if cause else ""))[:400]


def _find_uv(choice):
    """The command that runs uv here (a list), or None: pip then. On PATH, beside this python, or its
    ``uv`` package's binary (``pip install uv`` puts it in the python's bin, which PATH may not name).
    ``server/_doctor.installer_here`` follows the same rule for `doctor`: change both together."""
    if choice == "pip":
        return None
    found = shutil.which("uv")
    beside = os.path.join(os.path.dirname(sys.executable), "uv")
    if found is None and os.access(beside, os.X_OK):
        found = beside
    if found is None:
        try:
            from uv import find_uv_bin

            found = find_uv_bin()
        except Exception:  # noqa: BLE001 - no uv package, or one without its binary: pip
            found = None
    return [found] if found else None


def _uv_version(uv):
    try:
        done = subprocess.run(uv + ["--version"], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        said = done.stdout.decode(errors="replace").split()
        return "uv " + said[1] if len(said) >= 2 and said[0] == "uv" else "uv"
    except (OSError, subprocess.SubprocessError):
        return "uv"


def _shadow_base(env_dir, exclude=()):
    """uv reads only the environment's own site-packages (astral-sh/uv#2500), not the base
    interpreter's that ``--system-site-packages`` shows: without help it would download torch
    again. So the base's distributions get metadata-only copies in the environment while uv
    runs (METADATA, and a RECORD naming only the copy, so that an upgrade removes just the
    copy); they are removed after it: imports and versions are the base's, as with pip."""
    from importlib import metadata

    site_dir = sysconfig.get_path("purelib", vars={"base": env_dir, "platbase": env_dir})
    made, seen = [], set(exclude)
    cwd = os.getcwd()
    for dist in metadata.distributions(path=[p for p in sys.path if p not in ("", cwd)]):
        folder = str(getattr(dist, "_path", "") or "")
        try:
            name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
            text = dist.read_text("METADATA")
        except Exception:  # noqa: BLE001 - a broken dist-info: uv does not see it, as it would not anyway
            continue
        if not name or name in seen or not folder.endswith(".dist-info") or not text:
            continue
        seen.add(name)
        copy = os.path.join(site_dir, os.path.basename(folder))
        if os.path.exists(copy):
            continue
        os.makedirs(copy)
        base = os.path.basename(copy)
        files = {"METADATA": text, "INSTALLER": SHADOW + "\n"}
        direct = dist.read_text("direct_url.json")
        if direct:
            files["direct_url.json"] = direct
        files["RECORD"] = "".join("%s/%s,,\n" % (base, key) for key in list(files) + ["RECORD"])
        for key, value in files.items():
            with open(os.path.join(copy, key), "w") as out:
                out.write(value)
        made.append(copy)
    return made


def _unshadow(made):
    for copy in made:
        try:
            with open(os.path.join(copy, "INSTALLER")) as source:
                mine = source.read().strip() == SHADOW
        except OSError:
            continue  # uv replaced it: the environment now holds its own version of that package
        if mine:
            shutil.rmtree(copy, ignore_errors=True)


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
        uv = _find_uv(config.get("installer", "auto"))
        if config.get("installer") == "uv" and uv is None:
            shutil.rmtree(env_dir, ignore_errors=True)
            return {"error": "installer: uv, and there is no uv on PATH, beside %s, or in its uv package"
                             % sys.executable, "requirement": "", "log": ""}
        argv = ([answer["python"], "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
                 "--no-warn-script-location"] if uv is None else uv + ["pip", "install", "--python", answer["python"]])
        argv += ["-r", os.path.join(env_dir, "requirements.txt")]
        if config["index"] is False:
            argv.append("--no-index")
        elif isinstance(config["index"], str):
            argv += ["--index-url", config["index"]]
        if answer["wheels"]:
            argv += ["--find-links", answer["wheels"]]
        env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", UV_NO_PROGRESS="1",
                   UV_PYTHON_DOWNLOADS="never")
        shadows = _shadow_base(env_dir, exclude=("distrun",) if answer["needs_distrun"] else ()) if uv else []
        wheels_lock = open(answer["wheels"] + ".lock", "a") if answer["wheels"] else None
        try:
            if wheels_lock is not None:
                fcntl.flock(wheels_lock, fcntl.LOCK_SH)  # no collection removes the folder under the install
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=env, timeout=PIP_TIMEOUT_S)
        except OSError as exc:  # a uv that cannot run (not executable, another platform's binary)
            shutil.rmtree(env_dir, ignore_errors=True)
            return {"error": "cannot run %s: %s" % (argv[0], exc.strerror or exc), "requirement": "", "log": ""}
        finally:
            _unshadow(shadows)
            if wheels_lock is not None:
                wheels_lock.close()
        log = done.stdout.decode(errors="replace")
        installer = _uv_version(uv) if uv else "pip"
        if done.returncode != 0:
            shutil.rmtree(env_dir, ignore_errors=True)
            line = _last_error(log) if uv is None else _last_uv_error(log)
            if uv is None and "No module named pip" in log:
                line = ("%s has no pip to install %s with (`%s -m ensurepip`, the python3-pip package, or uv)"
                        % (sys.executable, ", ".join(requirements), sys.executable))
            return {"error": line, "requirement": _requirement_of(line, requirements), "log": log[-4000:],
                    "installer": installer}
        with open(os.path.join(env_dir, "install.log"), "w") as out:
            out.write(log)
        with open(os.path.join(env_dir, MARKER), "w") as out:  # last: the environment is whole
            json.dump({"name": answer["name"], "requirements": requirements, "built_at": time.time(),
                       "installer": installer, "wheels": answer["wheels"]}, out)
    return dict(answer, ready=True, installed=True, installer=installer)


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


def _write_lease(folder, job, job_dir):
    """``<job>.<hash of job_dir>``, whole or not at all: hosts sharing a workdir over NFS lease one
    layer for one job at the same moment, each naming its own job folder. One file for both, each
    truncating and writing it, once left the shorter JSON followed by the longer one's tail: read as
    unreadable, so in use, and the layer was never removed."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    name = "%s.%s" % (os.path.basename(job) or "job", hashlib.sha256(job_dir.encode()).hexdigest()[:12])
    staged = os.path.join(folder, ".%s.%d" % (name, os.getpid()))
    with open(staged, "w") as out:
        json.dump({"folder": job_dir, "at": time.time()}, out)
    os.replace(staged, os.path.join(folder, name))


def _mark_used(config, answer):
    """A ready environment was chosen: its last use is now, and a job's lease says who uses it."""
    env_dir = answer["dir"]
    try:
        with open(os.path.join(env_dir, LAST_USED), "w"):
            pass
        lease = config.get("lease")
        if lease:
            _write_lease(os.path.join(env_dir, LEASES), str(lease["job"]), _absolute(str(lease["folder"])))
    except OSError:
        pass  # a read-only environment is still usable; it is only never removed


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
                answer["removed"] = collect_old(_absolute(config["root"]), config.get("keep", 5), answer["dir"])
            except OSError:
                answer["removed"] = []  # an old environment that stays is no reason to fail a build that worked
    if answer.get("python") is not None and answer.get("ready"):
        _mark_used(config, answer)
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
