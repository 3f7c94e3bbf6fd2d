"""`distrun predict --cluster`: a predict job on a cluster's hosts, and its file brought home.

A predict job is a training job's processes (``ClusterJob``: the same hosts, placement, live
view and one-line errors); what differs is where its two files are, as no folder of the
client's exists on the hosts (shared storage is not assumed):

* the output: rank 0 writes it in its host's job folder (``<state dir>/jobs/<job>/predictions.pt``),
  and once every host has succeeded the client copies it to ``--output`` over the SSH connection
  it already holds, as ``distrun pull`` copies a checkpoint. The copy is part of the outcome: a
  job whose file did not come home has not succeeded;
* the checkpoint: ``--checkpoint-dir`` names a folder on the hosts (the path a cluster training
  job was given, read as its ``--resume`` reads it: the newest any host holds, which a rank whose
  host lacks a plain one receives over the process group); a ``--checkpoint`` that exists on the client is shipped first
  into rank 0's host's job folder (a plain file: the other ranks receive it from rank 0) or every
  training host's (a sharded one, file by file: each rank reads its host's shards), and the copies
  are removed when the job ends.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from distrun.client._links import HostLink, Placement
from distrun.client._results import CHECKPOINT_NAME
from distrun.client.cluster_job import ClusterJob
from distrun.client.local import JobOutcome
from distrun.config import JobSpec, PredictSpec
from distrun.errors import CheckpointError, HostError, TrainingError

__all__ = ["PredictJob", "PREDICTIONS_NAME"]

#: The file rank 0 writes in its host's job folder.
PREDICTIONS_NAME = "predictions.pt"
#: The job folder's subfolder a client checkpoint is shipped into (removed when the job ends).
_SHIPPED = "shipped"


class PredictJob(ClusterJob):
    """``plan()`` it as a ``ClusterJob``, ``place(output, checkpoint, ship)`` its files, then
    ``start(spec, bundle)`` with ``predict_env()`` in the spec's ``extra_env``."""

    _home: Path | None = None  # --output, on the client
    _on_hosts: dict[str, str | None]  # host label -> the checkpoint its ranks read (None: the newest in the dir)
    _shipped_to: list[HostLink]

    def place(self, output: Path, checkpoint: str | None, ship: Path | None) -> None:
        """``output``: the client's file; ``checkpoint``: a path on the hosts (or None: the newest in
        the spec's ``--checkpoint-dir``); ``ship``: a checkpoint here, copied to the hosts first."""
        self._home = output
        self._shipped_to = []
        self._on_hosts = {link.label: checkpoint for link in self._links}
        if ship is not None:
            self._ship_checkpoint(ship)

    @property
    def on_chief(self) -> str:
        """Where rank 0 writes the outputs: its host's job folder (absolute, as its server sees it)."""
        return f"{self._state_dir(self._links[0])}/jobs/{self.job_id}/{PREDICTIONS_NAME}"

    def predict_env(self) -> dict[str, str]:
        """The PredictSpec of rank 0's host, for the spec every host is sent (each host gets its own
        checkpoint path at submit)."""
        return self._env_for(self._links[0].label)

    def _env_for(self, label: str) -> dict[str, str]:
        return PredictSpec(output=self.on_chief, checkpoint=self._on_hosts.get(label)).to_env()

    def _submit_to(self, link: HostLink, placement: Placement, attempt_id: str, spec: JobSpec, *,
                   join: bool = False) -> None:
        """A host's ranks read their host's copy of a shipped checkpoint."""
        spec = spec.replace(extra_env={**spec.extra_env, **self._env_for(link.label)})
        super()._submit_to(link, placement, attempt_id, spec, join=join)

    def _ship_checkpoint(self, checkpoint: Path) -> None:
        """Copy a checkpoint here into the job folder of rank 0's host (a ``ckpt-<step>.pt`` file) or
        of every training host, all at once (a sharded ``ckpt-<step>/`` folder's files)."""
        name = checkpoint.name
        if not CHECKPOINT_NAME.match(name):
            raise CheckpointError(f"--checkpoint {checkpoint}: not a checkpoint distrun writes (expected "
                                  "ckpt-<step>.pt or ckpt-<step>/)")
        if checkpoint.is_dir():
            files = {part.name: part.read_bytes() for part in sorted(checkpoint.iterdir()) if part.is_file()}
        else:
            files = {"": checkpoint.read_bytes()}

        def send(link: HostLink) -> None:
            folder = f"{self._state_dir(link)}/jobs/{self.job_id}/{_SHIPPED}"
            target = f"{folder}/{name}"
            made = link.remote.run(["mkdir", "-p", "--", target if checkpoint.is_dir() else folder])
            if not made.ok:
                raise HostError(link.label, f"cannot make {folder} for the shipped checkpoint: {made.last_line()}")
            self._shipped_to.append(link)
            for part, data in files.items():
                link.remote.write_file(f"{target}/{part}" if part else target, data)
            self._on_hosts[link.label] = target

        # A plain file goes to rank 0's host alone: the other ranks receive it from rank 0 over the
        # job's process group (strategies/checkpoint/agreed.py), not each over the client's uplink.
        # A sharded one's shards are read by each rank from its own host, so every host gets them.
        to = self._links if checkpoint.is_dir() else self._links[:1]
        with ThreadPoolExecutor(max_workers=min(32, len(to))) as pool:
            list(pool.map(send, to))
        if not checkpoint.is_dir():
            self._on_hosts = dict.fromkeys(self._on_hosts, self._on_hosts[self._links[0].label])

    @staticmethod
    def _state_dir(link: HostLink) -> str:
        assert link.info is not None, "plan() opened the link"
        return link.info.state_dir

    def outcome(self) -> JobOutcome:
        """Every host succeeded, and the outputs are home at ``--output``."""
        done = super().outcome()
        self._bring_home()
        return done

    def _bring_home(self) -> None:
        """Rank 0's file, read from its host, written beside ``--output`` and renamed into place."""
        assert self._home is not None, "place() first"
        data = self._links[0].remote.read_bytes(self.on_chief)
        partial = self._home.with_name(f".{self._home.name}.partial-{os.getpid()}")
        try:
            partial.write_bytes(data)
            os.replace(partial, self._home)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise TrainingError(f"--output {self._home}: the predictions came from {self._links[0].label} but "
                                f"cannot be written here: {exc.strerror or exc}") from None

    def close(self) -> None:
        """Remove the shipped copies (the client holds the original), then close the links."""
        shipped, self._shipped_to = list(getattr(self, "_shipped_to", ())), []
        for link in shipped:
            try:
                link.remote.run(["rm", "-rf", "--", f"{self._state_dir(link)}/jobs/{self.job_id}/{_SHIPPED}"])
            except HostError:
                pass  # a host gone: its copy goes with its job folder
        super().close()
