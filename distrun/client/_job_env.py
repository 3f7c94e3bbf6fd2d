"""One cluster job's environment: its own ``--requirements`` on top of the cluster's, then the skew checks.

``distrun train --requirements FILE`` (or ``cluster: {requirements: FILE}`` in a job file)
gives one job more packages than the cluster file's ``requirements:``. Like Ray's per-job
``runtime_env``, they are a **layer**: a virtualenv built on each host, on first use, by
the same stdlib-only script `up` uses (``_env_host.py``), with the host's server
interpreter (the cluster's environment) as its base, so what that environment holds is
seen and not installed again. Its name hashes the job's requirements with the cluster's
environment (and that interpreter), so a later job with the same file reuses it, and a
changed cluster environment gets its own. The ranks of that job, and only they, get the
layer's site-packages first on their ``PYTHONPATH`` (a warm fork honours it as a fresh
interpreter does: ``launch/_zygote``); the server and the next job without the option
never see it. The wheels are the cluster file's ``wheels:``, its ``index:`` the same. Each
job leases its layer on each host (``_env_host``: no build removes a leased layer while the
job's folder there has no result), as the cluster file's ``keep_environments`` bounds them.

Then, before any rank starts, ``client/_skew`` checks every host against the client and
the recipe, with the layer in place.

Under ``--elastic`` a host joins the running job later: a lost host whose server is back, or
one added to the cluster file. :meth:`PreparedHosts.join` does the same for that one host
before its ranks are submitted (its layer found or built, and leased; then the skew checks),
so a joiner's ranks import what the first ranks did.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from distrun.client._environment import EnvironmentPlan, build_environment, check_environment, plan_environment
from distrun.client._links import HostLink
from distrun.client._skew import check_hosts, ranks_python
from distrun.config import ClusterSpec, JobSpec
from distrun.config._environment import parse_environment
from distrun.errors import ConfigError, HostError

__all__ = ["JobEnvironment", "PreparedHosts", "prepare_hosts", "job_plan"]


@dataclass(frozen=True)
class JobEnvironment:
    """What `distrun train` asked of the hosts' environments for one job."""

    requirements: str | None = None  # a requirements file on the client: this job's own packages
    allow_skew: bool = False  # versions may differ from the client's (a missing package never may)


@dataclass(frozen=True)
class PreparedHosts:
    """Per host label: the variables the job's ranks get there (its layer on ``PYTHONPATH``); and what
    a host that joins later (``--elastic``) needs to be prepared the same way (:meth:`join`)."""

    env: dict[str, dict[str, str]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # the layer's environment name, per host
    plan: EnvironmentPlan | None = None  # the job's layer (None: no --requirements)
    allow_skew: bool = False
    shipped: tuple[str, ...] = ()  # the bundle's files: the recipe's own modules are not asked of a host
    job_id: str = ""  # the layer's lease on each host

    def join(self, link: HostLink, spec: JobSpec) -> PreparedHosts:
        """A host joining the running job: its layer built where missing and leased to the job, then the
        skew checks, as :func:`prepare_hosts` did for the first hosts. A HostError (one line, the
        host named) if it cannot run the job; else these hosts with ``link``'s added (or renewed:
        a host back from a loss may run another interpreter now)."""
        layers: dict[str, tuple[str, str]] = {}
        env, names = dict(self.env), dict(self.names)
        if self.plan is not None:
            python, site, name = _layer(link, self.plan, self.job_id)
            layers[link.label] = (python, site)
            env[link.label], names[link.label] = {"PYTHONPATH": site}, name
        check_hosts([link], spec, self.shipped, allow_skew=self.allow_skew, layers=layers)
        return replace(self, env=env, names=names)

    def spec_for(self, label: str, spec: JobSpec) -> JobSpec:
        extra = self.env.get(label)
        if not extra:
            return spec
        merged = dict(spec.extra_env)
        for key, value in extra.items():
            merged[key] = f"{value}:{merged[key]}" if key == "PYTHONPATH" and merged.get(key) else value
        return replace(spec, extra_env=merged)


def job_plan(cluster: ClusterSpec, requirements: str) -> EnvironmentPlan:
    """The layer's plan: the job's requirement lines, the cluster's wheels and index, named by both."""
    path = Path(requirements).expanduser().resolve()

    def err(key: str, message: str) -> ConfigError:
        return ConfigError(f"--requirements: {message}")

    spec = parse_environment({"requirements": str(path)}, err, path.parent)
    lines = spec.requirements if spec is not None else ()
    if not lines:
        raise ConfigError(f"--requirements: {path} names no requirement")
    base = plan_environment(cluster)
    index = cluster.environment.index if cluster.environment is not None else True
    plain = hashlib.sha256(json.dumps({"job": lines, "base": base.plain, "index": index}).encode()).hexdigest()
    return EnvironmentPlan(requirements=lines, wheels=base.wheels, index=index, wanted=True, root=base.root,
                           plain=plain, with_distrun=hashlib.sha256(f"{plain}\0distrun".encode()).hexdigest(),
                           keep=base.keep, installer=base.installer)


def _layer(link: HostLink, plan: EnvironmentPlan, job_id: str) -> tuple[str, str, str]:
    """(the ranks' python, the layer's site-packages, its name) on ``link``'s host, built if missing;
    leased to ``job_id`` there, so that no build removes it while the job runs."""
    python = ranks_python(link)
    host = replace(link.host, python=python)
    plan = replace(plan, lease=(job_id, f"{link.state_dir}/jobs/{job_id}"))
    found = check_environment(link.remote, host, plan)
    if found.name is None:
        raise HostError(link.label, f"could not find the job's environment with {python}")
    built = build_environment(link.remote, host, plan, found)
    if built.site is None or built.name is None:
        raise HostError(link.label, f"the job's environment {found.name} has no site-packages folder")
    return python, built.site, built.name


def prepare_hosts(links: list[HostLink], cluster: ClusterSpec, spec: JobSpec, shipped: tuple[str, ...],
                  environment: JobEnvironment | None, job_id: str) -> PreparedHosts:
    """The job's layer on every host (all at once; one failed install is one line, exit 6), then the
    skew checks; a HostError names the first host that cannot run the job."""
    environment = environment or JobEnvironment()
    layers: dict[str, tuple[str, str]] = {}
    prepared = PreparedHosts(allow_skew=environment.allow_skew, shipped=tuple(shipped), job_id=job_id)
    if environment.requirements:
        plan = job_plan(cluster, environment.requirements)
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(links)))) as pool:
            built = list(pool.map(lambda link: _layer(link, plan, job_id), links))
        layers = {link.label: (python, site) for link, (python, site, _) in zip(links, built)}
        prepared = replace(prepared, plan=plan,
                           env={link.label: {"PYTHONPATH": site} for link, (_, site, _) in zip(links, built)},
                           names={link.label: name for link, (_, _, name) in zip(links, built)})
    check_hosts(links, spec, shipped, allow_skew=environment.allow_skew, layers=layers)
    return prepared
