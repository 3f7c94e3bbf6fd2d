"""The life of a ps task process: build the shards, serve workers, report, leave.

A ps task builds the recipe's model from the job's seed (the same initial
parameters one-device training starts from), keeps only the shards placement
gives it, and the recipe's optimizer over them. It serves until the chief says
the job is over, sending a PsStats event about once a second for the live view.
"""

from __future__ import annotations

import os
import threading
import time
from types import ModuleType
from typing import Any

import torch

from distrun.config import JobSpec
from distrun.protocol import Done, Output
from distrun.protocol.secret import job_secret_from
from distrun.runtime._process import EventWriter, LaunchEnv
from distrun.strategies.step.precision import PRECISION_DTYPES
from distrun.strategies.ps.layout import Layout
from distrun.strategies.ps.server import ParameterServer, serve_forever

_STATS_INTERVAL_S = 1.0


def ps_wire_dtype(spec: JobSpec) -> torch.dtype | None:
    """What a parameter-server job's pushes and pulls cross in (``--compression fp16|bf16``)."""
    return PRECISION_DTYPES.get(spec.communication.compression_spec.kind)


def serve_ps(recipe: ModuleType, spec: JobSpec, launch: LaunchEnv, writer: EventWriter, store: Any) -> None:
    """``store``: a client of the job's TCPStore, where worker connections are numbered."""
    task = launch.rank - spec.trainer_ranks
    torch.manual_seed(spec.training.seed)  # the same initial parameters as every other strategy
    model = recipe.model()
    hybrid = spec.strategy.embeddings == "ps"
    if hybrid:  # --embeddings ps: only the large tables, each split by rows, updated row by row in rounds
        from distrun.strategies.ps.tables import Tables, is_table, table_paths

        model = Tables(model, table_paths(model, spec.ps.partition_bytes))
    layout = Layout(model, spec.ps.tasks, spec.ps.partition_bytes, rows_of=is_table if hybrid else None)
    server = ParameterServer(task, layout, model, recipe.optimizer, sync=spec.ps.sync or hybrid,
                             max_staleness=spec.ps.max_staleness, wait_for_load=spec.checkpoint.resume,
                             expected_workers=spec.strategy.replicas, wire=ps_wire_dtype(spec), rowwise=hybrid,
                             elastic=hybrid and bool(spec.strategy.elastic))  # rounds follow the membership
    del model  # only the shards stay

    def report() -> None:
        writer.emit(server.stats(launch.rank))

    def note(text: str) -> None:
        writer.emit(Output(rank=launch.rank, time=time.time(), stream="stdout", line=f"[ps{task}] {text}"))

    stop_reports = threading.Event()

    def reports() -> None:
        while not stop_reports.wait(_STATS_INTERVAL_S):
            report()

    reporter = threading.Thread(target=reports, name="ps-stats", daemon=True)
    reporter.start()
    report()
    serve_forever(server, store, note, job_secret_from(os.environ))
    stop_reports.set()
    report()
    writer.emit(Done(rank=launch.rank, time=time.time(), steps=server.applied, final_loss=None, samples_per_s=0.0,
                     first_step_time=None))
