"""``--tracker wandb``: one Weights & Biases run.

wandb is imported when the run starts, never at import. A host with no W&B credentials
gets an offline run folder rather than a login prompt: a training rank has no terminal,
and a job must never wait on one. ``wandb sync`` uploads the folder later. The run does not
capture the console (``console="off"``): distrun already collects every rank's output, and
W&B rewiring rank 0's stdout and stderr would sit between the rank and its launcher.
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from distrun.errors import ConfigError
from distrun.runtime.tracking._calls import note, one_line
from distrun.runtime.tracking.api import RunParams

__all__ = ["WandbTracker"]

#: W&B's cloud: ``wandb login`` stores its key in netrc under this host.
_CLOUD_HOST = "api.wandb.ai"


class WandbTracker:
    name = "wandb"

    def __init__(self, folder: str | None, project: str | None, run_name: str | None) -> None:
        """``folder``: where W&B makes its ``wandb/<run>`` folder; None: rank 0's working folder."""
        self.folder = folder
        self.project = project
        self.run_name = run_name
        self._run: Any = None

    def start(self, params: RunParams) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("--tracker wandb needs the wandb package on the chief host: "
                              "pip install 'distrun[wandb]'") from None
        folder = Path(self.folder or os.getcwd())
        offline = not os.environ.get("WANDB_MODE") and not _has_credentials(wandb)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(project=self.project, name=self.run_name, dir=str(folder), job_type="train",
                                   config=params.as_dict(), mode="offline" if offline else None,
                                   settings=wandb.Settings(console="off"))
        except Exception as exc:  # noqa: BLE001 - wandb raises its own errors, and OSError for the folder
            raise ConfigError(f"--tracker wandb: cannot start a run in {folder}: {one_line(exc)}") from None
        if offline:
            run_folder = getattr(self._run.settings, "sync_dir", None) or str(Path(self._run.dir).parent)
            note(f"W&B: no API key here; offline run in {run_folder}, `wandb sync {run_folder}` uploads it")

    def log_metrics(self, step: int, metrics: Mapping[str, float], wall_time_s: float) -> None:
        self._run.log(dict(metrics), step=step)  # W&B stamps its own time

    def log_summary(self, summary: Mapping[str, float]) -> None:
        self._run.summary.update(dict(summary))

    def log_artifact(self, path: str) -> None:
        """A ``model`` artifact named for the run, aliased ``latest`` and ``ckpt-N``.

        W&B copies the file (or the folder's files) into its staging folder until the upload
        (``WANDB_DATA_DIR``, by default ``~/.local/share/wandb``), so a later prune of the
        checkpoint folder cannot take it away from an offline run that is not yet synced.
        """
        import wandb

        local = Path(path)
        stem = local.name.removesuffix(".pt")
        artifact = wandb.Artifact(f"checkpoint-{self._run.id}", type="model",
                                  metadata={"checkpoint": local.name, "path": str(local)})
        if local.is_dir():
            artifact.add_dir(str(local), name=local.name)
        else:
            artifact.add_file(str(local))
        self._run.log_artifact(artifact, aliases=["latest", stem])

    def finish(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


def _has_credentials(wandb: Any) -> bool:
    """Whether W&B would find an API key without asking: its environment variables, its
    settings files, or netrc (where ``wandb login`` writes it)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        settings = wandb.setup().settings
        if settings.api_key:
            return True
        hosts = {urlsplit(settings.base_url).hostname, _CLOUD_HOST}
    except Exception:  # noqa: BLE001 - an older wandb: look in netrc for the cloud's key
        hosts = {_CLOUD_HOST}
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):
        return False
    return any(host and entries.authenticators(host) for host in hosts)
