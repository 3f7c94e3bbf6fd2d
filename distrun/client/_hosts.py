"""Which hosts of a cluster run a job's ranks, in rank order, by strategy and role."""

from __future__ import annotations

from distrun.config import ClusterSpec, HostSpec, Role, StrategyName
from distrun.errors import ConfigError

__all__ = ["training_hosts", "ps_hosts"]


def training_hosts(cluster: ClusterSpec, strategy: StrategyName, *,
                   embeddings_ps: bool = False) -> tuple[HostSpec, ...]:
    """Hosts that run ranks: every worker for multi-worker, sharded and diloco; one host (rank 0's)
    otherwise; for parameter-server every worker host, then every ps host (one ps task each).
    ``embeddings_ps`` (the hybrid, ``--embeddings ps``): the strategy's hosts, then every ps host,
    whose ps tasks hold the tables, as parameter-server's hold the model."""
    workers = [host for host in cluster.hosts if Role.WORKER in host.roles]
    workers.sort(key=lambda host: not host.is_chief)  # the chief, when it trains, holds rank 0
    if not workers:
        cluster.require_strategy(strategy.value)
    if strategy is StrategyName.PARAMETER_SERVER:
        return tuple(workers) + ps_hosts(cluster)
    every_worker = strategy in (StrategyName.MULTI_WORKER, StrategyName.SHARDED, StrategyName.DILOCO)
    trainers = tuple(workers) if every_worker else tuple(workers[:1])
    if embeddings_ps:
        tables = ps_hosts(cluster)
        if not tables:
            raise ConfigError(f"{cluster.source or 'cluster'}: hosts: --embeddings ps keeps the tables on ps tasks, "
                              "one on each host with role 'ps', and no host has it")
        return trainers + tables
    return trainers


def ps_hosts(cluster: ClusterSpec) -> tuple[HostSpec, ...]:
    """The hosts with role ps; each runs one ps task, and nothing else of the job."""
    hosts = tuple(host for host in cluster.hosts if Role.PS in host.roles)
    for host in hosts:
        if Role.WORKER in host.roles:
            raise ConfigError(f"{cluster.source or 'cluster'}: host {host.label} has roles worker and ps; under "
                              "--strategy parameter-server and --embeddings ps a host runs workers or a ps task, "
                              "not both")
    return hosts
