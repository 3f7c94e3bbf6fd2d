"""Run on a host by the host's own ``python -c``: find or build the environment `up` asked for.

This file is sent as source, not imported there: the host's interpreter may not have
distrun at all (distrun itself may be what the environment brings), so it uses the
standard library only and imports nothing of distrun's. It reads one JSON object on
stdin and prints one JSON object on stdout::

    python -c SOURCE check|build   < {"root", "version", "wanted", "requirements", "index", "complete",
                                      "variants": {"plain"|"with_distrun": {"spec", "wheels"}}}

``check`` says which interpreter the server should run and whether its environment is
ready; ``build`` makes it ready. An environment is a virtualenv ``root/<name>`` layered
on this interpreter: ``--system-site-packages``, and when this interpreter is itself a
virtualenv, a ``.pth`` that adds its site folders too (a venv made from a venv is
layered on the base interpreter only), so torch and CUDA installed here are used, not
downloaded again. Its name hashes the client's spec (requirements and wheels' sha256s)
with this interpreter's version, prefix and platform: a changed ``python:`` is another
environment. The ready marker is written last, after pip succeeded; a failed build is
removed, so the next `up` starts clean and the cluster is left as it was. A lock per
name makes two hosts sharing a home folder (NFS) build it once.
"""

import fcntl
import hashlib
import json
import os
import platform
import shutil
import site
import subprocess
import sys
import sysconfig
import time

MARKER = ".distrun-ready"
PIP_TIMEOUT_S = 1800


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
    said.update(python=os.path.join(env_dir, "bin", "python"), name=name, needs_distrun=needs, dir=env_dir,
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


def main():
    config = json.loads(sys.stdin.read())
    answer = _answer(config)
    if sys.argv[1] == "build" and answer["python"] is not None:
        answer = _build(config, answer)
    print(json.dumps(answer))
    return 1 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
