"""Whether a local job's ranks get a network of their own (``launch/_netns``), decided by the client.

A private network closes the job's store and gloo pairs to the machine's other users, and takes
the ranks' way out with it. So a job whose trackers talk to a server (MLflow over HTTP, W&B
online) keeps the machine's network, and says so in one line; ``DISTRUN_NETWORK=host`` asks for
the machine's network too (a recipe that downloads its data in the ranks). Any other value of it
is refused, naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from distrun.config import JobSpec
from distrun.errors import ConfigError

__all__ = ["NETWORK_VAR", "network_choice"]

NETWORK_VAR = "DISTRUN_NETWORK"
_CHOICES = ("private", "host")
_SERVERS = ("http://", "https://", "databricks")


def network_choice(spec: JobSpec, environ: Mapping[str, str] = os.environ) -> tuple[bool, str | None]:
    """(a private network for the job's ranks, the note saying why not where the job needs the way out)."""
    choice = environ.get(NETWORK_VAR, "private").strip().lower() or "private"
    if choice not in _CHOICES:
        raise ConfigError(f"${NETWORK_VAR}: expected private or host. Received: {environ[NETWORK_VAR]!r}")
    if choice == "host":
        return False, None
    outbound = _needs_the_way_out(spec, environ)
    if outbound is None:
        return True, None
    return False, (f"note: {outbound} talks to a server, so the ranks use this machine's network, whose loopback "
                   "its other users can reach (docs/security.md#co-tenants)")


def _needs_the_way_out(spec: JobSpec, environ: Mapping[str, str]) -> str | None:
    for tracker in spec.observe.trackers:
        if tracker == "mlflow":
            uri = spec.observe.tracker_uris.get("mlflow") or environ.get("MLFLOW_TRACKING_URI", "")
            if uri.startswith(_SERVERS):
                return f"--tracker mlflow at {uri}"
        elif tracker == "wandb" and environ.get("WANDB_MODE", "") not in ("offline", "disabled", "dryrun") \
                and _wandb_online(environ):
            return "--tracker wandb"
    return None


def _wandb_online(environ: Mapping[str, str]) -> bool:
    """W&B syncs as it goes with a key (its variables, or netrc where `wandb login` writes it), or
    when told to; without one it runs offline (``runtime/tracking/_wandb``)."""
    if environ.get("WANDB_MODE") == "online" or environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        return "api.wandb.ai" in (Path(environ.get("NETRC") or Path.home() / ".netrc")).read_text()
    except OSError:
        return False
