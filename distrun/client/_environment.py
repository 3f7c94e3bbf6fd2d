"""Each host's Python environment, as the cluster file's ``requirements:`` and ``wheels:`` say.

`up` asks every host (in parallel, one SSH connection each) which interpreter its server
should run, with one command that builds nothing (``check``). The answer is the host's
``python`` as is, when nothing is asked of it and its distrun is the client's version, or
an environment named by content: the requirements, the sha256 of every wheel, and (when
the host's python has no distrun or another version) the client's own distrun as a wheel
(``_self_wheel``). A ready environment costs nothing more. Otherwise the wheels go to the
host once per set of hashes (over SFTP), and ``build`` makes the virtualenv with uv where
the host has it, else pip (``_env_host`` runs there, with the host's python and the
standard library only); the row's note says which.

A failed install is one line, ``HOST: installing REQ failed: <pip's or uv's last error line>``
(HostError, exit 6), and nothing of it stays on the host.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from distrun._version import __version__
from distrun.client._self_wheel import self_wheel, source_digest
from distrun.config._environment import DEFAULT_KEEP_ENVIRONMENTS
from distrun.config.cluster import ClusterSpec, HostSpec
from distrun.errors import ConfigError, HostError
from distrun.links import CommandFailed, Remote

__all__ = ["EnvironmentPlan", "HostEnvironment", "EnvironmentFailed", "plan_environment", "check_environment",
           "build_environment", "host_script"]

#: pip over a slow mirror, building a package from source: as long as a setup command may take.
BUILD_TIMEOUT_S = 1800.0
_COMPLETE = ".complete"


class EnvironmentFailed(HostError):
    """pip could not build a host's environment: `up` then changes no host's server."""


@dataclass(frozen=True)
class LocalWheel:
    filename: str
    sha256: str
    path: str  # on the client


@dataclass(frozen=True)
class EnvironmentPlan:
    """What every host's environment is made of, hashed on the client once per command."""

    requirements: tuple[str, ...]
    wheels: tuple[LocalWheel, ...]
    index: bool | str
    wanted: bool  # the cluster file asks for packages (else: an environment only to bring distrun)
    root: str  # the hosts' environments folder, relative to the login directory or absolute
    plain: str  # the spec's digest without distrun
    with_distrun: str  # ... and with the client's distrun in it
    keep: int = DEFAULT_KEEP_ENVIRONMENTS  # after a build, the newest environments a host keeps
    lease: tuple[str, str] | None = None  # (job id, its folder on the host): the job uses the environment
    installer: str = "auto"  # ``installer:``: auto (uv where a host has it, else pip), uv or pip

    def wheels_dir(self, with_distrun: bool) -> str | None:
        shas = [wheel.sha256 for wheel in self.wheels] + ([source_digest()] if with_distrun else [])
        if not shas:
            return None
        return f"{self.root}/wheels-{hashlib.sha256(' '.join(sorted(shas)).encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class HostEnvironment:
    """The interpreter a host's server runs, and what `up` did to have it."""

    python: str
    name: str | None = None  # None: the host's python as is
    ready: bool = True
    needs_distrun: bool = False
    wheels_ready: bool = True
    installed: bool = False  # this `up` built it
    site: str | None = None  # its site-packages folder (a job's layer goes first on the ranks' PYTHONPATH)
    installer: str | None = None  # what built it, when this `up` did: "pip" or "uv 0.9.2"

    @property
    def note(self) -> str:
        if self.name is None:
            return ""
        what = f"built with {self.installer}" if self.installed and self.installer else (
            "built" if self.installed else "reused")
        return f"environment {self.name} {what}" + (" (distrun from the client)" if self.needs_distrun else "")


def plan_environment(cluster: ClusterSpec) -> EnvironmentPlan:
    spec = cluster.environment
    wheels = _local_wheels(spec.wheels, cluster.label) if spec and spec.wheels else ()
    requirements = spec.requirements if spec else ()
    # Without these keys an environment only brings distrun: from the client's wheel, offline, its
    # dependencies the host's own (`index: true` lets pip fetch them).
    index: bool | str = spec.index if spec is not None else False
    plain = hashlib.sha256(json.dumps({"requirements": requirements, "wheels": [w.sha256 for w in wheels],
                                       "index": index}, sort_keys=True).encode()).hexdigest()
    return EnvironmentPlan(requirements=requirements, wheels=wheels, index=index,
                           wanted=spec is not None and not spec.empty, root=cluster.environments_dir,
                           plain=plain, with_distrun=_with_distrun(plain),
                           keep=spec.keep if spec is not None else DEFAULT_KEEP_ENVIRONMENTS,
                           installer=spec.installer if spec is not None else "auto")


def check_environment(remote: Remote, host: HostSpec, plan: EnvironmentPlan) -> HostEnvironment:
    """Which interpreter the host's server runs; nothing is built or sent. An interpreter that cannot
    run the check (not a Python, or too old) is taken as is: the version probe then says what it is."""
    try:
        said = _run_script(remote, host, plan, "check", timeout_s=60.0)
    except CommandFailed:
        return HostEnvironment(python=host.python)
    return _answer(host, said, check=True)


def build_environment(remote: Remote, host: HostSpec, plan: EnvironmentPlan, found: HostEnvironment) -> HostEnvironment:
    """Send the wheels (unless the host has them) and build the environment ``found`` names."""
    if found.ready or found.name is None:
        return found
    try:
        if not found.wheels_ready:
            _send_wheels(remote, host, plan, found.needs_distrun)
        said = _run_script(remote, host, plan, "build", timeout_s=BUILD_TIMEOUT_S)
    except CommandFailed as exc:  # not pip's verdict (a full disk, a crash): still no server is touched
        raise EnvironmentFailed(host.label, f"building environment {found.name} failed: {exc.result.last_line()}",
                                detail=exc.detail) from None
    return _answer(host, said, check=False)


def _answer(host: HostSpec, said: dict[str, Any], *, check: bool) -> HostEnvironment:
    if "error" in said:
        requirement = said.get("requirement") or "the requirements"
        raise EnvironmentFailed(host.label, f"installing {requirement} failed: {said['error']}",
                                detail=said.get("log"))
    if said.get("python") is None:
        return HostEnvironment(python=host.python)
    return HostEnvironment(python=str(said["python"]), name=str(said["name"]), ready=bool(said["ready"]),
                           needs_distrun=bool(said["needs_distrun"]), wheels_ready=bool(said.get("wheels_ready")),
                           installed=not check and bool(said.get("installed")),
                           site=str(said["site"]) if said.get("site") else None,
                           installer=str(said["installer"]) if said.get("installer") else None)


def _run_script(remote: Remote, host: HostSpec, plan: EnvironmentPlan, mode: str, *, timeout_s: float) -> dict:
    config = {
        "root": plan.root, "version": __version__, "wanted": plan.wanted, "requirements": list(plan.requirements),
        "index": plan.index, "complete": _COMPLETE, "keep": plan.keep, "installer": plan.installer,
        "lease": {"job": plan.lease[0], "folder": plan.lease[1]} if plan.lease else None,
        "variants": {"plain": {"spec": plan.plain, "wheels": plan.wheels_dir(False)},
                     "with_distrun": {"spec": plan.with_distrun, "wheels": plan.wheels_dir(True)}},
    }
    result = remote.run([host.python, "-c", host_script(), mode], stdin=json.dumps(config), timeout_s=timeout_s)
    if result.exited == 127 or (not result.stdout.strip() and "No such file" in result.stderr):
        raise HostError(host.label, f"python {host.python!r} not found; set `python:` in the cluster file to an "
                                    "interpreter that exists on this host")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    try:
        said = json.loads(lines[-1])
    except (IndexError, ValueError, RecursionError):
        raise CommandFailed(host.label, result, "finding the environment") from None
    if not isinstance(said, dict):
        raise CommandFailed(host.label, result, "finding the environment")
    return said


def _send_wheels(remote: Remote, host: HostSpec, plan: EnvironmentPlan, with_distrun: bool) -> None:
    folder = plan.wheels_dir(with_distrun)
    if folder is None:
        return
    made = remote.run(["sh", "-c", 'umask 077 && mkdir -p -- "$1"', "sh", folder])
    if not made.ok:
        raise CommandFailed(host.label, made, f"creating {folder}")
    for wheel in plan.wheels:
        remote.write_file(f"{folder}/{wheel.filename}", _read_wheel(wheel))
    if with_distrun:
        own = self_wheel()
        remote.write_file(f"{folder}/{own.filename}", own.data)
    remote.write_file(f"{folder}/{_COMPLETE}", b"")  # last: the folder is whole


def _read_wheel(wheel: LocalWheel) -> bytes:
    try:
        data = Path(wheel.path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"wheels: cannot read {wheel.path}: {exc.strerror or exc}") from None
    if hashlib.sha256(data).hexdigest() != wheel.sha256:
        raise ConfigError(f"wheels: {wheel.path} changed while `up` ran; run it again")
    return data


def _local_wheels(folder: str, where: str) -> tuple[LocalWheel, ...]:
    wheels = []
    try:
        paths = sorted(Path(folder).glob("*.whl"))
        for path in paths:
            wheels.append(LocalWheel(path.name, hashlib.sha256(path.read_bytes()).hexdigest(), str(path)))
    except OSError as exc:
        raise ConfigError(f"{where}: wheels: cannot read {exc.filename or folder}: {exc.strerror or exc}") from None
    return tuple(wheels)


def _with_distrun(plain: str) -> str:
    return hashlib.sha256(f"{plain}\0distrun {__version__} {source_digest()}".encode()).hexdigest()


@lru_cache(maxsize=1)
def host_script() -> str:
    """``_env_collect.py``'s source, then ``_env_host.py``'s: run on a host as ``python -c SOURCE MODE``
    (it may have no distrun to import them from)."""
    here = Path(__file__).parent
    return "\n\n".join((here / name).read_text(encoding="utf-8") for name in ("_env_collect.py", "_env_host.py"))
