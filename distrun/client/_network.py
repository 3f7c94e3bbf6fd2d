"""Whether a local job's ranks get a network of their own (``launch/_netns``), decided by the client.

A private network closes the job's store and gloo pairs to the machine's other users, and takes
the ranks' way out with it. So a job keeps the machine's network, and says so in one line, when
its trackers may talk to a server (MLflow at anything but a local file or SQLite URI, W&B unless
told to stay offline), or when the user named an interface for gloo or NCCL (the namespace has
only ``lo``). ``DISTRUN_NETWORK=host`` asks for the machine's network too (a recipe that downloads
its data in the ranks); any other value of it is refused, naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from distrun.config import JobSpec
from distrun.errors import ConfigError

__all__ = ["NETWORK_VAR", "network_choice"]

NETWORK_VAR = "DISTRUN_NETWORK"
_CHOICES = ("private", "host")
#: MLflow tracking URIs that stay on this machine: its default (./mlruns), a folder, a file:, SQLite.
_LOCAL_SCHEMES = ("", "file", "sqlite")
#: Variables that place gloo's or NCCL's sockets: a value other than lo names an interface (or a
#: peer) a private network does not have.
_INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_COMM_ID")


def network_choice(spec: JobSpec, environ: Mapping[str, str] = os.environ) -> tuple[bool, str | None]:
    """(a private network for the job's ranks, the note saying why not where the job needs the
    machine's). ``environ``: the client's; the job's ``extra_env`` is laid over it, as the ranks get it."""
    env = {**environ, **spec.extra_env}
    choice = env.get(NETWORK_VAR, "private").strip().lower() or "private"
    if choice not in _CHOICES:
        raise ConfigError(f"${NETWORK_VAR}: expected private or host. Received: {env[NETWORK_VAR]!r}")
    if choice == "host":
        return False, None
    reason = _needs_the_machines_network(spec, env)
    if reason is None:
        return True, None
    return False, (f"note: {reason}, so the ranks use this machine's network, whose loopback its other users can "
                   f"reach (docs/security.md#co-tenants)")


def _needs_the_machines_network(spec: JobSpec, env: Mapping[str, str]) -> str | None:
    for name in _INTERFACE_VARS:
        value = env.get(name, "").strip()
        if value and value != "lo":
            return f"${name}={value} names what a job's own network does not have"
    for tracker in spec.observe.trackers:
        if tracker == "mlflow":
            uri = spec.observe.tracker_uris.get("mlflow") or env.get("MLFLOW_TRACKING_URI", "")
            lowered = uri.lower()
            scheme = ("databricks" if lowered.startswith("databricks") else  # MLflow's name for Databricks
                      lowered.partition(":")[0] if "://" in uri or lowered.startswith(("file:", "sqlite:")) else "")
            if scheme not in _LOCAL_SCHEMES:
                return f"--tracker mlflow at {uri} talks to a server"
        elif tracker == "wandb" and env.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
            return "--tracker wandb may sync as it goes (WANDB_MODE=offline keeps it here)"
    return None
