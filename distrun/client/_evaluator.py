"""The evaluator role on a cluster: each new checkpoint, evaluated on another host.

TensorFlow's evaluator reads checkpoints from shared storage; distrun does not
assume any, so the client relays: when rank 0 reports a checkpoint, the newest
one is read from rank 0's host and written to the evaluator host (both over the
SSH connections the client already holds), and that host's server runs one
evaluation process on it. The workers never wait: the relay runs on its own
thread, and when checkpoints come faster than evaluations, only the newest is
evaluated. Results reach the live view as Eval events of EVALUATOR_RANK.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from pathlib import PurePosixPath

from distrun.client._bundle import Bundle
from distrun.client._feed import EventFeed
from distrun.client._links import HostLink
from distrun.client._results import checkpoint_parts
from distrun.config import JobSpec
from distrun.errors import HostError
from distrun.protocol import EVALUATOR_RANK, Eval, Failed, Output, decode_event
from distrun.protocol.secret import new_job_secret

#: At the end of training, how long the client waits for the last checkpoint's evaluation.
FINAL_EVAL_WAIT_S = 120.0


class EvaluatorRelay:
    def __init__(self, job_id: str, evaluator: HostLink, bundle: Bundle, spec: JobSpec, feed: EventFeed,
                 rank_hosts: list[str]) -> None:
        self.job_id = job_id
        self.rank_hosts = rank_hosts  # for the evaluator's TF_CONFIG
        self.evaluator = evaluator
        self.bundle = bundle
        self.spec = spec
        self.feed = feed
        self._pending: tuple[HostLink, str, int] | None = None
        self._closing = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="evaluator-relay", daemon=True)
        self._thread.start()

    def offer(self, source: HostLink, path: str, step: int) -> None:
        """A new checkpoint on ``source``: evaluate it next (replacing any not yet started)."""
        with self._changed:
            self._pending = (source, path, step)
            self._changed.notify_all()

    def finish(self, *, wait: bool) -> None:
        """Training ended: evaluate what is pending (``wait``) or drop it, then stop."""
        with self._changed:
            self._closing = True
            if not wait:
                self._pending = None
            self._changed.notify_all()
        self._thread.join(FINAL_EVAL_WAIT_S if wait else 10.0)

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._pending is None and not self._closing:
                    self._changed.wait()
                if self._pending is None:
                    return
                source, path, step = self._pending
                self._pending = None
            try:
                self._evaluate(source, path, step)
            except HostError as exc:
                self._note(f"checkpoint of step {step} not evaluated: {exc.message}")

    def _evaluate(self, source: HostLink, path: str, step: int) -> None:
        eval_id = f"{self.job_id}-eval-{step}"
        relative = self._relay(source, path, eval_id)
        spec = self.spec.replace(resume=False)
        self.evaluator.call("submit", job=eval_id, bundle=self.bundle.sha256, recipe=self.bundle.recipe,
                            spec=spec.to_json(), eval_checkpoint=relative, detach=True,
                            rank_hosts=self.rank_hosts, evaluator_hosts=[self.evaluator.host.address],
                            secret=new_job_secret())
        with self.evaluator.client() as client:
            for item in client.stream("follow", job=eval_id, offset=0, silence_s=30.0):
                for raw in item.get("events", ()):
                    event = decode_event(json.dumps(raw))
                    if isinstance(event, Eval):
                        self.feed.put(dataclasses.replace(event, rank=EVALUATOR_RANK))
                    elif isinstance(event, Output):
                        self.feed.put(dataclasses.replace(event, rank=EVALUATOR_RANK))
                    elif isinstance(event, Failed):
                        self._note(f"checkpoint of step {step}: {event.message}")

    def _relay(self, source: HostLink, path: str, eval_id: str) -> str:
        """Copy the checkpoint at ``path`` on ``source`` into the evaluator's folder; its path there.
        A sharded checkpoint is a folder: its files, as ``source``'s server names them."""
        target = self.evaluator.remote
        if PurePosixPath(path).suffix != ".pt":  # a folder: its server names its files
            named = checkpoint_parts(source, source.call("artifacts", job=self.job_id))
            if named is None or named[0] != path or named[2] is None:
                raise HostError(source.label, f"{path} is no longer the newest checkpoint")
            relative = f"jobs/{eval_id}"
            target.run(["mkdir", "-p", f"{self.evaluator.state_dir}/{relative}"])
            for part in named[2]:
                target.write_file(f"{self.evaluator.state_dir}/{relative}/{part}",
                                  source.remote.read_bytes(f"{path}/{part}"))
            return relative
        relative = f"jobs/{eval_id}.pt"
        target.write_file(f"{self.evaluator.state_dir}/{relative}", source.remote.read_bytes(path))
        return relative

    def _note(self, text: str) -> None:
        self.feed.put(Output(rank=EVALUATOR_RANK, time=time.time(), stream="stderr", line=f"[evaluator] {text}"))
