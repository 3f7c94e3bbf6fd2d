"""Cluster file validation: every mistake is one line with file, line and key path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from distrun.config import Role, load_cluster, parse_cluster
from distrun.errors import ConfigError

MINIMAL = "hosts:\n  - {address: gpu-1, roles: [chief, worker]}\n  - {address: gpu-2}\n"


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_cluster(text, "c.yaml", base_dir=Path("/base"))
    return err.value.message


def test_the_design_example_parses(tmp_path: Path) -> None:
    path = tmp_path / "lab.yaml"
    path.write_text("""\
name: lab
ssh:
  user: alice
  port: 22
  identity_file: keys/id_ed25519
  known_hosts: ~/.ssh/known_hosts
python: /opt/venv/bin/python
workdir: ~/.distrun
setup: ["pip install -q distrun"]
env: {NCCL_DEBUG: WARN, OMP_NUM_THREADS: 4}
network: {interface: eth0, port_range: [29500, 29600]}
hosts:
  - {address: gpu-1, roles: [chief, worker], gpus: auto}
  - {address: gpu-2, roles: [worker], gpus: 4, ssh: {port: 2222, user: bob}}
  - {address: cpu-1, roles: [ps]}
  - {address: 'fe80::1', roles: [evaluator]}
""")
    cluster = load_cluster(path)
    assert cluster.name == "lab" and len(cluster.hosts) == 4
    gpu1, gpu2, cpu1, ev = cluster.hosts
    assert gpu1.ssh.identity_file == str(tmp_path / "keys" / "id_ed25519")  # relative to the file
    assert gpu1.ssh.known_hosts == os.path.expanduser("~/.ssh/known_hosts")
    assert (gpu2.ssh.port, gpu2.ssh.user, gpu2.gpus, gpu1.gpus) == (2222, "bob", 4, None)
    assert gpu2.ssh.identity_file == gpu1.ssh.identity_file  # inherited from the top-level ssh
    assert cluster.chief is gpu1 and cpu1.roles == (Role.PS,)
    assert dict(cluster.env) == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4"}
    assert cluster.network.port_range == (29500, 29600)
    assert gpu2.label == "gpu-2:2222" and gpu2.state_id == "gpu-2_2222" and ev.state_id == "fe80__1"
    assert cluster.host_state_dir(gpu1) == ".distrun/lab/gpu-1"  # ~/ becomes relative to the login dir
    cluster.require_strategy("parameter-server")


def test_the_first_worker_becomes_chief_when_none_is_named() -> None:
    cluster = parse_cluster("hosts:\n  - {address: a, roles: [ps]}\n  - {address: b}\n  - {address: c}\n")
    assert [h.address for h in cluster.hosts if h.is_chief] == ["b"]
    assert cluster.hosts[1].roles == (Role.CHIEF, Role.WORKER)


@pytest.mark.parametrize("text, expected", [
    ("hosts:\n  - {address: a, roles: [chief]}\n  - {address: b, roles: [chief, worker]}\n",
     "c.yaml:3: hosts[1].roles: a second chief (hosts[0] is one); exactly one host may be chief"),
    ("hosts:\n  - {address: a}\n  - {address: a}\n",
     "c.yaml:3: hosts[1].address: a is listed twice (also hosts[0]); give each host once"),
    ("hosts:\n  - {address: a}\n  - {address: b, rolse: [worker]}\n",
     "c.yaml:3: hosts[1].rolse: unknown key (did you mean 'roles'?); known keys: address, roles, gpus, slots, ssh, python"),
    ("hosts:\n  - {address: a, roles: [wroker]}\n",
     "c.yaml:2: hosts[0].roles[0]: unknown role 'wroker' (did you mean 'worker'?); roles are chief, worker, ps, evaluator"),
    ("hots:\n  - a\n", "c.yaml:1: hots: unknown key (did you mean 'hosts'?); known keys: name, scheduler, "
                       "slurm, ssh, python, workdir, setup, requirements, wheels, index, keep_environments, installer, env, network, hosts, job"),
    ("name: x\n", "c.yaml:1: hosts: is required: list the machines of the cluster"),
    ("hosts: []\n", "c.yaml:1: hosts: must be a non-empty list of hosts. Received: []"),
    ("ssh: {port: 70000}\nhosts: [a]\n", "c.yaml:1: ssh.port: must be between 1 and 65535. Received: 70000"),
    ("ssh: {connect_timeout_s: 0}\nhosts: [a]\n", "c.yaml:1: ssh.connect_timeout_s: must be a number of seconds in (0, 600]. Received: 0"),
    ("ssh: {accept_new_host_keys: 'yes'}\nhosts: [a]\n", "c.yaml:1: ssh.accept_new_host_keys: must be true or false. Received: 'yes'"),
    ("hosts:\n  - {address: a, gpus: -1}\n", "c.yaml:2: hosts[0].gpus: must be >= 0. Received: -1"),
    ("hosts:\n  - {address: a, slots: 0}\n", "c.yaml:2: hosts[0].slots: must be >= 1. Received: 0"),
    ("hosts:\n  - {address: a, roles: [chief, ps]}\n", "c.yaml:2: hosts[0].roles: a host cannot be both chief and ps"),
    ("hosts:\n  - {address: a, roles: [ps]}\n", "c.yaml:1: hosts: no host has role 'chief' or 'worker'"),
    ("env: {RANK: 3}\nhosts: [a]\n", "c.yaml:1: env.RANK: is set by distrun for every training process; it cannot be overridden"),
    ("env: {'A B': 1}\nhosts: [a]\n", "c.yaml:1: env.A B: is not a valid environment variable name"),
    ("env: {A: [1]}\nhosts: [a]\n", "c.yaml:1: env.A: must be a string or a number. Received: [1]"),
    ("network: {port_range: [30000, 29000]}\nhosts: [a]\n", "c.yaml:1: network.port_range: first port 30000 is above last port 29000"),
    ("workdir: relative/dir\nhosts: [a]\n", "c.yaml:1: workdir: must be an absolute path or start with ~/. Received: 'relative/dir'"),
    ("workdir: ~bob/x\nhosts: [a]\n", "c.yaml:1: workdir: must be an absolute path or start with ~/. Received: '~bob/x'"),
    ("python: -c\nhosts: [a]\n", "c.yaml:1: python: must be an interpreter path or name, not an option. Received: '-c'"),
    ("setup: [1]\nhosts: [a]\n", "c.yaml:1: setup[0]: must be a non-empty shell command. Received: 1"),
    ("hosts:\n  - {address: a}\nhosts: []\n", "c.yaml:3: hosts: duplicate key"),
    ("hosts: [a\n", "c.yaml:2: not valid YAML: expected ',' or ']', but got '<stream end>'"),
])
def test_mistakes_name_file_line_and_key(text: str, expected: str) -> None:
    assert error_of(text) == expected


def test_a_slurm_cluster_file_becomes_sbatch_options() -> None:
    cluster = parse_cluster(
        "name: lab\nscheduler: slurm\npython: /opt/venv/bin/python\n"
        "slurm: {nodes: 2, partition: gpu, time: '02:00:00', gpus_per_node: 8, cpus_per_task: 16, account: ml,\n"
        "        qos: high, constraint: 'a100&ib', extra_args: [--exclusive, --mem=0],\n"
        "        login: {address: login1, ssh: {port: 2222, user: alice}}}\n", "c.yaml")
    assert cluster.hosts == () and cluster.slurm is not None
    assert cluster.slurm.sbatch_args() == [
        "--nodes=2", "--ntasks-per-node=1", "--partition=gpu", "--time=02:00:00", "--account=ml", "--qos=high",
        "--constraint=a100&ib", "--gpus-per-node=8", "--cpus-per-task=16", "--exclusive", "--mem=0"]
    assert cluster.slurm.python == "/opt/venv/bin/python" and cluster.slurm.grace_s == 120
    login = cluster.slurm.login
    assert login is not None and (login.address, login.ssh.port, login.ssh.user) == ("login1", 2222, "alice")
    assert parse_cluster("scheduler: slurm\nslurm: {nodes: 1, time: 90}\n").slurm.time == "90"  # minutes


@pytest.mark.parametrize("text, expected", [
    ("scheduler: slurm\n", "c.yaml:1: slurm: is required with scheduler: slurm (at least `nodes:`)"),
    ("scheduler: slurm\nslurm: {partition: gpu}\n", "c.yaml:2: slurm: needs `nodes:` (how many nodes to ask for)"),
    ("scheduler: slurm\nslurm: {nodes: 2}\nhosts: [a]\n",
     "c.yaml:3: hosts: a Slurm cluster lists no hosts: its nodes are the allocation's (say how many in slurm.nodes)"),
    ("slurm: {nodes: 2}\nhosts: [a]\n", "c.yaml:1: slurm: needs `scheduler: slurm`"),
    ("scheduler: slrum\nslurm: {nodes: 2}\n",
     "c.yaml:1: scheduler: unknown scheduler 'slrum' (did you mean 'slurm'?); known: ssh, slurm"),
    ("scheduler: slurm\nslurm: {nodes: 2, partition: 'gpu --wrap=id'}\n",
     "c.yaml:2: slurm.partition: is not a Slurm partition name. Received: 'gpu --wrap=id'"),
    ("scheduler: slurm\nslurm: {nodes: 2, extra_args: ['--wrap=id']}\n",
     "c.yaml:2: slurm.extra_args[0]: --wrap is set by distrun; it cannot be given here"),
    ("scheduler: slurm\nslurm: {nodes: 2, extra_args: ['-w n1']}\n",
     "c.yaml:2: slurm.extra_args[0]: is not one sbatch option, --name or --name=value. Received: '-w n1'"),
    ("scheduler: slurm\nslurm: {nodes: 2, time: tomorrow}\n",
     "c.yaml:2: slurm.time: is not a Slurm time limit such as \"02:00:00\", \"1-12:00:00\" or 90 (minutes). "
     "Received: 'tomorrow'"),
    ("scheduler: slurm\nslurm: {nodes: 2, constraint: 'a100;id'}\n",
     "c.yaml:2: slurm.constraint: is not a Slurm constraint of feature names and & | , [ ]. Received: 'a100;id'"),
    ("scheduler: slurm\nslurm: {nodes: 2, grace_s: 5}\n",
     "c.yaml:2: slurm.grace_s: must be between 10 and 65535. Received: 5"),
    ("scheduler: slurm\nslurm: {nodes: 2, gpus_per_node: 0}\n",
     "c.yaml:2: slurm.gpus_per_node: must be >= 1. Received: 0"),
    ("scheduler: slurm\nslurm: {nodes: 2, login: {address: '-oProxyCommand=id'}}\n",
     "c.yaml:2: slurm.login.address: is not a host name or IP address. Received: '-oProxyCommand=id'"),
])
def test_slurm_mistakes_name_file_line_and_key(text: str, expected: str) -> None:
    assert error_of(text) == expected


@pytest.mark.parametrize("address", [
    "h1;touch /tmp/x", "-oProxyCommand=touch /tmp/x", "$(touch /tmp/x)", "`id`", "h1 h2", "h1\nh2", "a|b",
    "a&b", "a>b", "'a'", "-p22", "", "a..b", "x" * 300,
])
def test_hostile_addresses_are_rejected(address: str) -> None:
    text = yaml.safe_dump({"hosts": [{"address": address}]})
    message = error_of(text)
    assert "hosts[0].address:" in message and ("not a host name or IP address" in message or "must be" in message)


@pytest.mark.parametrize("user", ["root;id", "-oProxyCommand=x", "a b", "$(id)"])
def test_hostile_user_names_are_rejected(user: str) -> None:
    message = error_of(yaml.safe_dump({"ssh": {"user": user}, "hosts": ["a"]}))
    assert message.startswith("c.yaml:") and ": ssh.user: is not a user name" in message


def test_env_values_are_kept_literally() -> None:
    value = "line1\n$(touch /tmp/x)\n'; rm -rf /; '"
    cluster = parse_cluster(yaml.safe_dump({"env": {"HOSTILE": value}, "hosts": ["a"]}))
    assert cluster.env["HOSTILE"] == value


def test_strategy_requirements_are_checked() -> None:
    cluster = parse_cluster(MINIMAL, "c.yaml")
    cluster.require_strategy("multi-worker")
    with pytest.raises(ConfigError, match="c.yaml: hosts: strategy 'ps' needs at least one host with role 'ps'"):
        cluster.require_strategy("ps")
    evaluator_only = parse_cluster("hosts:\n  - {address: a, roles: [chief]}\n  - {address: b, roles: [evaluator]}\n", "e.yaml")
    with pytest.raises(ConfigError, match="needs at least one host with role 'worker'"):
        evaluator_only.require_strategy("mirrored")


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"{tmp_path / 'x.yaml'}: no such file"):
        load_cluster(tmp_path / "x.yaml")


def test_parameter_server_hosts_workers_first_then_ps_and_never_both():
    from distrun.client.cluster_job import training_hosts
    from distrun.config import StrategyName

    cluster = parse_cluster("hosts:\n  - {address: p, roles: [ps]}\n  - {address: w, roles: [worker]}\n"
                            "  - {address: c, roles: [chief, worker]}\n")
    assert [h.address for h in training_hosts(cluster, StrategyName.PARAMETER_SERVER)] == ["c", "w", "p"]
    both = parse_cluster("hosts:\n  - {address: c}\n  - {address: x, roles: [worker, ps]}\n")
    with pytest.raises(ConfigError, match="host x has roles worker and ps"):
        training_hosts(both, StrategyName.PARAMETER_SERVER)
    with pytest.raises(ConfigError, match="needs at least one host with role 'ps'"):
        parse_cluster("hosts:\n  - {address: c}\n").require_strategy("parameter-server")
    # The hybrid: the strategy's hosts (mirrored: the chief's alone), then every ps host for the tables.
    assert [h.address for h in training_hosts(cluster, StrategyName.MIRRORED, embeddings_ps=True)] == ["c", "p"]
    assert [h.address for h in training_hosts(cluster, StrategyName.MULTI_WORKER, embeddings_ps=True)] == ["c", "w", "p"]
    with pytest.raises(ConfigError, match="--embeddings ps keeps the tables on ps tasks"):
        training_hosts(parse_cluster("hosts:\n  - {address: c}\n"), StrategyName.MIRRORED, embeddings_ps=True)
