"""The cluster file: frozen specs, validated before any connection is made.

Every rule here exists so that a mistake is reported with file, line and key
path (``cluster.yaml:9: hosts[1].roles: ...``, exit 2) instead of surfacing as a
half-started cluster. Addresses, user names and paths reach remote shells only
through ``shlex.quote``, but they are also restricted here, so a hostile value
such as ``-oProxyCommand=...`` or ``h1;touch /tmp/x`` never gets that far.

The format (docs/cluster.md)::

    name: lab
    ssh: {user: alice, port: 22, identity_file: ~/.ssh/id_ed25519,
          known_hosts: ~/.ssh/known_hosts, connect_timeout_s: 10,
          accept_new_host_keys: false}
    python: /opt/venv/bin/python
    workdir: ~/.distrun
    setup: ["pip install -q distrun"]
    requirements: requirements.txt    # or a list; wheels: and index: beside it (config/_environment)
    env: {NCCL_DEBUG: WARN}
    network: {interface: eth0, port_range: [29500, 29600]}
    hosts:
      - {address: gpu-1, roles: [chief, worker], gpus: auto}
      - {address: gpu-2, roles: [worker], gpus: 4, ssh: {port: 2222}}

or, on Slurm (docs/slurm.md), no hosts but what to ask for::

    scheduler: slurm
    slurm: {nodes: 2, partition: gpu, time: "02:00:00", gpus_per_node: 8}
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from distrun.config._environment import ENVIRONMENT_KEYS, EnvironmentSpec, parse_environment
from distrun.config._hosts import (
    DEFAULT_PYTHON,
    DEFAULT_WORKDIR,
    HostSpec,
    NetworkSpec,
    Role,
    SshSpec,
)
from distrun.config._slurm import (
    CONSTRAINT_PATTERN,
    EXTRA_ARG_PATTERN,
    NAME_PATTERN,
    REFUSED_EXTRA_ARGS,
    SLURM_KEYS,
    TIME_PATTERN,
    Allocation,
    SlurmSpec,
)
from distrun.config._suggest import did_you_mean
from distrun.config._yaml import Located, load_file, load_located
from distrun.config.job_file import JobOption, job_options
from distrun.errors import ConfigError

__all__ = [
    "ClusterSpec",
    "EnvironmentSpec",
    "HostSpec",
    "SshSpec",
    "NetworkSpec",
    "SlurmSpec",
    "Allocation",
    "Role",
    "load_cluster",
    "parse_cluster",
    "local_cluster",
    "RESERVED_ENV",
]

#: Variables distrun sets for every training process; the cluster file may not.
RESERVED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "TORCHELASTIC_USE_AGENT_STORE",
})

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_INTERFACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}$")


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    hosts: tuple[HostSpec, ...]
    workdir: str = DEFAULT_WORKDIR
    setup: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    network: NetworkSpec = field(default_factory=NetworkSpec)
    source: str | None = None  # the file it came from; None for the embedded local cluster
    local: bool = False  # the embedded default: no SSH, one host, this machine
    slurm: SlurmSpec | None = None  # scheduler: slurm; hosts come from an allocation
    allocation: Allocation | None = None  # the allocation ``hosts`` were taken from (Slurm, resolved)
    #: The file's ``job:`` section: default options of every `distrun train --cluster` on it
    #: (below the command line and ``--config``, above the recipe's ``defaults``).
    job: tuple[JobOption, ...] = ()
    #: ``requirements:``/``wheels:``: each host's environment, built by `up` (None: the host's python as is).
    environment: EnvironmentSpec | None = None

    @property
    def label(self) -> str:
        """How messages name the cluster file: its path, or the embedded default's name."""
        return self.source or "the local cluster"

    @property
    def chief(self) -> HostSpec:
        return next(host for host in self.hosts if host.is_chief)

    def host_state_dir(self, host: HostSpec) -> str:
        """The host's own folder (workdir/cluster name/host id), as the remote side sees it.

        ``~/`` becomes a path relative to the login directory, where both SSH
        commands and SFTP start, because a quoted ``~`` is never expanded.
        """
        return _join_remote(self.workdir, self.name, host.state_id)

    @property
    def environments_dir(self) -> str:
        """Where hosts keep the environments `up` builds (``workdir/.envs``, shared by the clusters
        on that workdir: an environment is named by its content; a cluster name never starts with '.')."""
        return _join_remote(self.workdir, ".envs")

    def require_strategy(self, strategy: str) -> None:
        """Fail early (exit 2, naming the file) when the hosts cannot run ``strategy``."""
        where = self.source or "the local cluster"
        workers = [h for h in self.hosts if Role.WORKER in h.roles]
        if strategy in ("parameter-server", "ps"):
            if not any(Role.PS in h.roles for h in self.hosts):
                raise ConfigError(f"{where}: hosts: strategy {strategy!r} needs at least one host with role 'ps'")
        if not workers:
            raise ConfigError(f"{where}: hosts: strategy {strategy!r} needs at least one host with role 'worker'")


def _join_remote(workdir: str, *parts: str) -> str:
    if workdir == "~":
        base = "."
    elif workdir.startswith("~/"):
        base = workdir[2:].rstrip("/") or "."
    else:
        base = workdir.rstrip("/") or "/"
    return "/".join([base, *parts])


# --------------------------------------------------------------------------- parsing

_TOP_KEYS = ("name", "scheduler", "slurm", "ssh", "python", "workdir", "setup", *ENVIRONMENT_KEYS, "env", "network",
             "hosts", "job")
_SCHEDULERS = ("ssh", "slurm")
_SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "connect_timeout_s", "accept_new_host_keys")
_HOST_KEYS = ("address", "roles", "gpus", "slots", "ssh", "python")
_NETWORK_KEYS = ("interface", "port_range")


def load_cluster(path: Path) -> ClusterSpec:
    """Read and validate a cluster file; every problem is a ConfigError with file:line."""
    return _Parser(load_file(path), base_dir=path.resolve().parent, default_name=path.stem).cluster()


def parse_cluster(text: str, source: str = "cluster.yaml", base_dir: Path | None = None) -> ClusterSpec:
    """Validate cluster YAML given as text (``source`` names it in errors)."""
    return _Parser(load_located(text, source), base_dir=base_dir or Path.cwd(), default_name=Path(source).stem).cluster()


def local_cluster(workdir: str, python: str) -> ClusterSpec:
    """The embedded default: this machine as a one-host cluster reached without SSH."""
    host = HostSpec(address="localhost", roles=(Role.CHIEF, Role.WORKER), ssh=SshSpec(), python=python)
    return ClusterSpec(name="local", hosts=(host,), workdir=workdir, local=True)


class _Parser:
    def __init__(self, doc: Located, *, base_dir: Path, default_name: str) -> None:
        self.doc = doc
        self.base_dir = base_dir
        self.default_name = default_name

    def err(self, path: str, message: str) -> ConfigError:
        return self.doc.error(path, message)

    # -- generic helpers

    def mapping(self, value: Any, path: str, known: tuple[str, ...]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.err(path, f"must be a mapping. Received: {_show(value)}")
        for key in value:
            if key not in known:
                child = f"{path}.{key}" if path else key
                raise self.err(child, f"unknown key{did_you_mean(key, known)}; known keys: {', '.join(known)}")
        return value

    def text(self, value: Any, path: str, *, pattern: re.Pattern[str] | None = None, what: str = "") -> str:
        if not isinstance(value, str) or not value:
            raise self.err(path, f"must be a non-empty string. Received: {_show(value)}")
        if "\x00" in value or "\n" in value or "\r" in value:
            raise self.err(path, f"must be one line without NUL. Received: {_show(value)}")
        if pattern is not None and not pattern.match(value):
            raise self.err(path, f"is not {what}. Received: {_show(value)}")
        return value

    def integer(self, value: Any, path: str, *, low: int, high: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.err(path, f"must be an integer. Received: {_show(value)}")
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"between {low} and {high}"
            raise self.err(path, f"must be {bound}. Received: {value}")
        return value

    def local_path(self, value: Any, path: str) -> str:
        raw = os.path.expanduser(self.text(value, path))
        return str((self.base_dir / raw).resolve()) if not os.path.isabs(raw) else raw

    # -- sections

    def cluster(self) -> ClusterSpec:
        top = self.doc.value
        if top is None:
            raise self.err("", "the file is empty; it needs at least `hosts:`")
        top = self.mapping(top, "", _TOP_KEYS)
        name = self.text(top.get("name", self.default_name), "name", pattern=_NAME,
                         what="a name of letters, digits, '.', '_' or '-'")
        ssh = self.ssh(top.get("ssh"), "ssh", SshSpec())
        python = self.python(top.get("python", DEFAULT_PYTHON), "python")
        workdir = self.workdir(top.get("workdir", DEFAULT_WORKDIR))
        setup = self.setup(top.get("setup"))
        environment = parse_environment(top, self.err, self.base_dir)
        env = self.env(top.get("env"))
        network = self.network(top.get("network"))
        scheduler = top.get("scheduler", "ssh")
        if scheduler not in _SCHEDULERS:
            raise self.err("scheduler", f"unknown scheduler {_show(scheduler)}{did_you_mean(str(scheduler), _SCHEDULERS)}; "
                                        f"known: {', '.join(_SCHEDULERS)}")
        slurm = None
        if scheduler == "slurm":
            if "hosts" in top:
                raise self.err("hosts", "a Slurm cluster lists no hosts: its nodes are the allocation's "
                                        "(say how many in slurm.nodes)")
            if "slurm" not in top:
                raise self.err("slurm", "is required with scheduler: slurm (at least `nodes:`)")
            slurm = self.slurm(top["slurm"], ssh, python)
            hosts: tuple[HostSpec, ...] = ()
        else:
            if "slurm" in top:
                raise self.err("slurm", "needs `scheduler: slurm`")
            if "hosts" not in top:
                raise self.err("hosts", "is required: list the machines of the cluster")
            hosts = self.hosts(top["hosts"], ssh, python)
        return ClusterSpec(name=name, hosts=hosts, workdir=workdir, setup=setup, env=MappingProxyType(env),
                           network=network, source=self.doc.source, slurm=slurm, job=job_options(self.doc, "job"),
                           environment=environment)

    def slurm(self, value: Any, ssh: SshSpec, python: str) -> SlurmSpec:
        raw = self.mapping(value, "slurm", SLURM_KEYS)
        if "nodes" not in raw:
            raise self.err("slurm", "needs `nodes:` (how many nodes to ask for)")
        nodes = self.integer(raw["nodes"], "slurm.nodes", low=1, high=100000)
        names = {}
        for key in ("partition", "account", "qos"):
            if raw.get(key) is not None:
                names[key] = self.text(raw[key], f"slurm.{key}", pattern=NAME_PATTERN, what=f"a Slurm {key} name")
        time_limit = raw.get("time")
        if time_limit is not None:
            if isinstance(time_limit, int) and not isinstance(time_limit, bool):
                time_limit = str(time_limit)  # minutes, as sbatch reads a bare number
            time_limit = self.text(time_limit, "slurm.time", pattern=TIME_PATTERN,
                                   what='a Slurm time limit such as "02:00:00", "1-12:00:00" or 90 (minutes)')
        counts = {key: self.integer(raw[key], f"slurm.{key}", low=1) for key in ("gpus_per_node", "cpus_per_task")
                  if raw.get(key) is not None}
        constraint = None
        if raw.get("constraint") is not None:
            constraint = self.text(raw["constraint"], "slurm.constraint", pattern=CONSTRAINT_PATTERN,
                                   what="a Slurm constraint of feature names and & | , [ ]")
        extra = raw.get("extra_args", [])
        if isinstance(extra, str):
            extra = [extra]
        if not isinstance(extra, list):
            raise self.err("slurm.extra_args", f"must be a list of sbatch options. Received: {_show(extra)}")
        extra_args = []
        for i, arg in enumerate(extra):
            path = f"slurm.extra_args[{i}]"
            arg = self.text(arg, path, pattern=EXTRA_ARG_PATTERN, what="one sbatch option, --name or --name=value")
            if arg.split("=", 1)[0] in REFUSED_EXTRA_ARGS:
                raise self.err(path, f"{arg.split('=', 1)[0]} is set by distrun; it cannot be given here")
            extra_args.append(arg)
        login = None
        if raw.get("login") is not None:
            login = self.host(raw["login"], "slurm.login", ssh, python)
        grace_s = self.integer(raw.get("grace_s", 120), "slurm.grace_s", low=10, high=65535)
        return SlurmSpec(nodes=nodes, python=python, time=time_limit, constraint=constraint, extra_args=tuple(extra_args),
                         login=login, grace_s=grace_s, **names, **counts)

    def ssh(self, value: Any, path: str, base: SshSpec) -> SshSpec:
        raw = self.mapping(value, path, _SSH_KEYS)
        spec = base
        if "user" in raw:
            spec = replace(spec, user=self.text(raw["user"], f"{path}.user", pattern=_USER, what="a user name"))
        if "port" in raw:
            spec = replace(spec, port=self.integer(raw["port"], f"{path}.port", low=1, high=65535))
        if "identity_file" in raw:
            spec = replace(spec, identity_file=self.local_path(raw["identity_file"], f"{path}.identity_file"))
        if "known_hosts" in raw:
            spec = replace(spec, known_hosts=self.local_path(raw["known_hosts"], f"{path}.known_hosts"))
        if "connect_timeout_s" in raw:
            timeout = raw["connect_timeout_s"]
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
                raise self.err(f"{path}.connect_timeout_s", f"must be a number of seconds in (0, 600]. Received: {_show(timeout)}")
            spec = replace(spec, connect_timeout_s=float(timeout))
        if "accept_new_host_keys" in raw:
            flag = raw["accept_new_host_keys"]
            if not isinstance(flag, bool):
                raise self.err(f"{path}.accept_new_host_keys", f"must be true or false. Received: {_show(flag)}")
            spec = replace(spec, accept_new_host_keys=flag)
        return spec

    def python(self, value: Any, path: str) -> str:
        python = self.text(value, path)
        if python.startswith("-"):
            raise self.err(path, f"must be an interpreter path or name, not an option. Received: {_show(python)}")
        return python

    def workdir(self, value: Any) -> str:
        workdir = self.text(value, "workdir")
        if workdir.startswith("-") or (workdir.startswith("~") and workdir != "~" and not workdir.startswith("~/")):
            raise self.err("workdir", f"must be an absolute path or start with ~/. Received: {_show(workdir)}")
        if not (workdir.startswith("/") or workdir.startswith("~")):
            raise self.err("workdir", f"must be an absolute path or start with ~/. Received: {_show(workdir)}")
        if ".." in workdir.split("/"):
            raise self.err("workdir", f"must not contain '..'. Received: {_show(workdir)}")
        return workdir

    def setup(self, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise self.err("setup", f"must be a list of shell commands. Received: {_show(value)}")
        commands = []
        for i, command in enumerate(value):
            if not isinstance(command, str) or not command.strip() or "\x00" in command:
                raise self.err(f"setup[{i}]", f"must be a non-empty shell command. Received: {_show(command)}")
            commands.append(command)
        return tuple(commands)

    def env(self, value: Any) -> dict[str, str]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.err("env", f"must be a mapping of variable names to values. Received: {_show(value)}")
        env: dict[str, str] = {}
        for key, item in value.items():
            path = f"env.{key}"
            if not _ENV_KEY.match(key):
                raise self.err(path, "is not a valid environment variable name")
            if key in RESERVED_ENV or key.startswith("DISTRUN_"):
                raise self.err(path, "is set by distrun for every training process; it cannot be overridden")
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise self.err(path, f"must be a string or a number. Received: {_show(item)}")
            text = str(item)
            if "\x00" in text:
                raise self.err(path, "must not contain NUL")
            env[key] = text  # newlines and $(...) are kept literally: values never pass through a shell
        return env

    def network(self, value: Any) -> NetworkSpec:
        raw = self.mapping(value, "network", _NETWORK_KEYS)
        interface = None
        if raw.get("interface") is not None:
            interface = self.text(raw["interface"], "network.interface", pattern=_INTERFACE, what="a network interface name")
        port_range = None
        if raw.get("port_range") is not None:
            ports = raw["port_range"]
            if not isinstance(ports, list) or len(ports) != 2:
                raise self.err("network.port_range", f"must be [first, last]. Received: {_show(ports)}")
            low = self.integer(ports[0], "network.port_range[0]", low=1024, high=65535)
            high = self.integer(ports[1], "network.port_range[1]", low=1024, high=65535)
            if low > high:
                raise self.err("network.port_range", f"first port {low} is above last port {high}")
            port_range = (low, high)
        return NetworkSpec(interface=interface, port_range=port_range)

    def hosts(self, value: Any, ssh: SshSpec, python: str) -> tuple[HostSpec, ...]:
        if not isinstance(value, list) or not value:
            raise self.err("hosts", f"must be a non-empty list of hosts. Received: {_show(value)}")
        hosts = [self.host(item, f"hosts[{i}]", ssh, python) for i, item in enumerate(value)]
        seen: dict[tuple[str, int], int] = {}
        for i, host in enumerate(hosts):
            key = (host.address.lower(), host.ssh.port)
            if key in seen:
                raise self.err(f"hosts[{i}].address",
                               f"{host.label} is listed twice (also hosts[{seen[key]}]); give each host once")
            seen[key] = i
        chiefs = [i for i, host in enumerate(hosts) if host.is_chief]
        if len(chiefs) > 1:
            raise self.err(f"hosts[{chiefs[1]}].roles", f"a second chief (hosts[{chiefs[0]}] is one); exactly one host may be chief")
        if not chiefs:
            # TensorFlow's rule: without a chief, worker 0 does the chief's work.
            first = next((i for i, host in enumerate(hosts) if Role.WORKER in host.roles), None)
            if first is None:
                raise self.err("hosts", "no host has role 'chief' or 'worker'")
            hosts[first] = replace(hosts[first], roles=(Role.CHIEF, *hosts[first].roles))
        return tuple(hosts)

    def host(self, value: Any, path: str, ssh: SshSpec, python: str) -> HostSpec:
        if isinstance(value, str):
            value = {"address": value}
        raw = self.mapping(value, path, _HOST_KEYS)
        if "address" not in raw:
            raise self.err(path, "needs an `address` (host name or IP)")
        address = self.address(raw["address"], f"{path}.address")
        roles = self.roles(raw.get("roles", ["worker"]), f"{path}.roles")
        gpus: int | None = None
        if raw.get("gpus", "auto") != "auto":
            gpus = self.integer(raw["gpus"], f"{path}.gpus", low=0)
        slots = None
        if raw.get("slots") is not None:
            slots = self.integer(raw["slots"], f"{path}.slots", low=1)
        host_ssh = self.ssh(raw.get("ssh"), f"{path}.ssh", ssh)
        host_python = self.python(raw["python"], f"{path}.python") if "python" in raw else python
        return HostSpec(address=address, roles=roles, ssh=host_ssh, python=host_python, gpus=gpus, slots=slots)

    def address(self, value: Any, path: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.err(path, f"must be a host name or IP address. Received: {_show(value)}")
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            pass
        if value.startswith("-") or not _HOSTNAME.match(value):
            raise self.err(path, f"is not a host name or IP address. Received: {_show(value)}")
        return value

    def roles(self, value: Any, path: str) -> tuple[Role, ...]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise self.err(path, f"must be a non-empty list of chief, worker, ps, evaluator. Received: {_show(value)}")
        known = [role.value for role in Role]
        roles: list[Role] = []
        for i, item in enumerate(value):
            if item not in known:
                raise self.err(f"{path}[{i}]", f"unknown role {_show(item)}{did_you_mean(str(item), known)}; "
                                               f"roles are {', '.join(known)}")
            role = Role(item)
            if role in roles:
                raise self.err(f"{path}[{i}]", f"role {item!r} is listed twice")
            roles.append(role)
        if Role.CHIEF in roles and Role.PS in roles:
            raise self.err(path, "a host cannot be both chief and ps")
        return tuple(roles)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
