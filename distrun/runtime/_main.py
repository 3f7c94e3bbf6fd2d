"""Entry point of a training process: ``python -m distrun.runtime``.

Order matters: tie our life to the launcher first, then report ``Started``,
join the process group, and only then import and run user code, so that any
failure from there on is reported as a Failed event naming the recipe line.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import time
from datetime import timedelta
from typing import Any

from distrun.config import JobSpec, PlanProbeSpec, PredictSpec, RecipeKind, StrategyName, inspect_recipe
from distrun.errors import RecipeError
from distrun.protocol import Done, Eval, Output, Started
from distrun.protocol.secret import job_secret_from
from distrun.protocol.environment import (
    CACHE_DIR_VAR,
    CHIEF_ADDR_VAR,
    CUT_OFF_EXIT_CODE,
    ELASTIC_JOINER_VAR,
    EVAL_CHECKPOINT_VAR,
    JOB_SPEC_VAR,
    PREEMPTED_EXIT_CODE,
)
from distrun.runtime._failure import describe_failure
from distrun.runtime._flight_recorder import allow_supervisor_to_trace, start_dump_listener
from distrun.runtime._heartbeat import start_heartbeat
from distrun.runtime._preempt import Preempted, install_preempt_handler
from distrun.runtime._process import EventWriter, LaunchEnv, die_with_parent, incarnation_id, match_thread_env
from distrun.runtime._error_file import prepare_error_file, recorded_failure, remove_error_file
from distrun.runtime._recipe import load_module, prepare_sys_path
from distrun.runtime._reporter import EventReporter, to_float

_STORE_TIMEOUT = timedelta(seconds=300)


def main() -> None:
    die_with_parent()
    match_thread_env()
    writer = EventWriter.from_environ()
    launch = LaunchEnv.from_environ()
    spec = JobSpec.from_json(os.environ[JOB_SPEC_VAR])
    phase = "setup"
    reporter: EventReporter | None = None
    error_file = prepare_error_file(launch.rank)
    install_preempt_handler()  # noted always; acted on (a checkpoint, then exit 75) when preemptible
    allow_supervisor_to_trace()  # distrun stacks: the launcher's py-spy may read this process
    start_dump_listener(launch.rank)  # --hang-timeout-s: the Flight Recorder, dumped on the launcher's word
    try:
        info = inspect_recipe(spec.recipe)
        hybrid = spec.strategy.embeddings == "ps"  # --embeddings ps: ps tasks beside DDP replicas
        ps_task = (spec.strategy.name is StrategyName.PARAMETER_SERVER or hybrid) and launch.rank >= spec.trainer_ranks
        if hybrid and info.kind is not RecipeKind.FIT:  # the ps tasks build the tables and their optimizer
            raise RecipeError(f"--embeddings ps trains fit-style recipes (model, optimizer, loss, train_data), where "
                              f"the ps tasks can build the tables and their optimizer; {spec.recipe} is a "
                              f"{info.kind.value}")
        device = _device(spec, launch) if not ps_task else _cpu()  # a ps task applies updates on its CPU
        if spec.observe.tensorboard_dir and (launch.rank == 0 or ps_task) and not os.environ.get(EVAL_CHECKPOINT_VAR):
            writer = _tensorboard(writer, spec, launch, ps_task)
        if spec.observe.trackers and launch.rank == 0 and not ps_task and not os.environ.get(EVAL_CHECKPOINT_VAR):
            writer = _trackers(writer, spec, launch)
        writer.emit(
            Started(rank=launch.rank, time=time.time(), pid=os.getpid(), device=str(device),
                    world_size=launch.world_size, recipe_kind=info.kind.value)
        )
        start_heartbeat(writer, launch.rank, spec.recipe)
        prepare_sys_path(spec.recipe, spec.training.args)
        store = _rendezvous_store(launch)
        if info.kind is RecipeKind.SCRIPT:
            phase = "train"
            if launch.world_size > 1:
                from distrun.runtime._teardown import keep_destroyed_process_groups

                keep_destroyed_process_groups()
            from distrun.runtime._script_progress import ScriptProgress  # steps, loss, samples/s: watched

            reporter = EventReporter(writer, launch.rank, launch.world_size, spec.observe.log_interval_s, device.type)
            reporter.profile = _profile_window(spec, launch, device, writer)
            ScriptProgress(reporter)
            if reporter.profile is not None:
                reporter.profile.open_now()
            runpy.run_path(spec.recipe, run_name="__main__")
            reporter.flush()
            writer.emit(Done(rank=launch.rank, time=time.time(), steps=reporter.current_step,
                             final_loss=to_float(reporter.last_loss), samples_per_s=reporter.samples_per_s,
                             first_step_time=reporter.first_step_time, peak_mem_mb=reporter.peak_mem_mb(),
                             net_bytes_sent=reporter.net_bytes_sent()))
            _leave_together(launch, store)
            _exit(0)
        if ps_task:
            phase = "import"
            module = load_module(spec.recipe)
            phase = "train"
            from distrun.runtime._ps_task import serve_ps  # a ps task: serve, never train

            serve_ps(module, spec, launch, writer, _store_client(launch))
            if hybrid:  # rank 0 hosts the store and waits for every rank, ps tasks included, to leave
                _leave_together(launch, None)
            _exit(0)
        if spec.strategy.elastic and info.kind is not RecipeKind.FIT:
            raise RecipeError(f"--elastic trains fit-style recipes (distrun's loop redoes a step after a change of "
                              f"membership); {spec.recipe} is a {info.kind.value}")
        reporter = EventReporter(writer, launch.rank, spec.trainer_ranks, spec.observe.log_interval_s, device.type)
        if not os.environ.get(EVAL_CHECKPOINT_VAR):
            reporter.profile = _profile_window(spec, launch, device, writer)
        strategy = _make_strategy(spec, launch, device, reporter, store)
        strategy.options = _loop_options(spec)
        phase = "import"
        module = load_module(spec.recipe)
        strategy.units_from = getattr(module, "shard_units", None)  # the blocks sharded and --activation-checkpointing use
        if hasattr(strategy, "tp_plan_from"):  # --tp/--pp: the recipe may name how its layers split
            strategy.tp_plan_from = getattr(module, "tp_plan", None)
            strategy.pp_chain_from = getattr(module, "pp_chain", None)
        phase = "train"

        def emit_eval(step: int, epoch: int, metrics: dict[str, float]) -> None:
            writer.emit(Eval(rank=launch.rank, time=time.time(), step=step, epoch=epoch, metrics=metrics))

        predicting = PredictSpec.from_env(os.environ)
        if predicting is not None:  # distrun predict: a checkpoint's model over predict_data, then leave
            from distrun.runtime._predict import predict

            batches = predict(module, strategy, spec, reporter, predicting)
            reporter.flush()
            writer.emit(Done(rank=launch.rank, time=time.time(), steps=batches, final_loss=None,
                             samples_per_s=reporter.samples_per_s, first_step_time=reporter.first_step_time,
                             peak_mem_mb=reporter.peak_mem_mb(), net_bytes_sent=reporter.net_bytes_sent()))
            strategy.close()
            if spec.strategy.name.collective:
                _leave_together(launch, store)
            _exit(0)
        probing = PlanProbeSpec.from_env(os.environ)
        if probing is not None:  # --strategy auto on a cluster: measure the model and the links, then leave
            from distrun.runtime._cluster_probe import probe_in_job

            probe_in_job(module, spec, strategy.device, probing)
            writer.emit(Done(rank=launch.rank, time=time.time(), steps=0, final_loss=None, samples_per_s=0.0,
                             first_step_time=None, peak_mem_mb=reporter.peak_mem_mb()))
            strategy.close()
            _leave_together(launch, store)
            _exit(0)
        checkpoint = os.environ.get(EVAL_CHECKPOINT_VAR)
        if checkpoint:  # the evaluator role: one checkpoint, then leave
            from distrun.runtime._evaluator import evaluate_checkpoint

            evaluate_checkpoint(module, strategy, spec, checkpoint, emit_eval)
            writer.emit(Done(rank=launch.rank, time=time.time(), steps=0, final_loss=None, samples_per_s=0.0,
                             first_step_time=None))
            _exit(0)
        if info.kind is RecipeKind.CUSTOM_LOOP:
            _before_custom_loop(strategy, spec, reporter)
            module.main(strategy)
            steps, final_loss, stopped_by = strategy.step, to_float(reporter.last_loss), None
        else:
            from distrun.runtime._fit import fit

            result = fit(module, strategy, spec, reporter, emit_eval)
            steps, final_loss, stopped_by = result.steps, result.final_loss, result.stopped_by
        reporter.flush()
        writer.emit(
            Done(rank=launch.rank, time=time.time(), steps=steps, final_loss=final_loss,
                 samples_per_s=reporter.samples_per_s, first_step_time=reporter.first_step_time,
                 peak_mem_mb=reporter.peak_mem_mb(), net_bytes_sent=reporter.net_bytes_sent(), reason=stopped_by)
        )
        strategy.close()
        if spec.strategy.name.collective:
            _leave_together(launch, store)
        _exit(0)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes an event, then exit 1
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            _exit(0)
        if type(exc).__name__ == "JobFinished":  # --elastic: a joiner came as the job ended; nothing to do
            writer.emit(Done(rank=launch.rank, time=time.time(), steps=0, final_loss=None, samples_per_s=0.0,
                             first_step_time=None))
            _exit(0)
        if type(exc).__name__ == "CutOff":  # --elastic: the job went on without us; a new process rejoins
            writer.emit(Output(rank=launch.rank, time=time.time(), stream="stderr",
                               line=f"[distrun] rank {launch.rank} {exc}; it leaves, to be started again as a joiner"))
            sys.stderr.flush()
            os._exit(CUT_OFF_EXIT_CODE)
        if isinstance(exc, KeyboardInterrupt):
            os._exit(130)
        if isinstance(exc, Preempted):  # every replica agreed on the step; its checkpoint is written
            writer.emit(Output(rank=launch.rank, time=time.time(), stream="stderr",
                               line=f"[distrun] told the job will end: {exc}, exit {PREEMPTED_EXIT_CODE}"))
            if spec.strategy.name.collective:
                _leave_together(launch, store)
            _exit(PREEMPTED_EXIT_CODE)
        if reporter is not None and reporter.profile is not None:
            reporter.profile.close()  # a failure inside the window: the steps before it are worth the most
        during = reporter.during if reporter is not None else None
        step = reporter.current_step + 1 if reporter is not None and during is None else None
        # A script that exits with a child's code: the child's @record says why, not "SystemExit: 1".
        recorded = recorded_failure(error_file, rank=launch.rank, step=step) if isinstance(exc, SystemExit) else None
        remove_error_file(error_file)
        writer.emit(recorded or describe_failure(exc, rank=launch.rank, recipe=spec.recipe, step=step, phase=phase,
                                                 during=during))
        sys.stderr.flush()
        os._exit(1)


_LEFT_KEY = "distrun/left"
_LEAVE_WAIT_S = 60.0


def _leave_together(launch: LaunchEnv, store: Any) -> None:
    """Rank 0 hosts the rendezvous store, so it leaves last.

    A rank still tearing down its process group (a plain script's objects are
    destroyed as its ``main()`` returns) talks to the store and to its peers; if
    rank 0 exited first, that rank would hang there. Every rank counts itself out
    on the store; rank 0 waits for the count (bounded) before it exits.
    """
    if launch.world_size <= 1 or not launch.master_port:
        return
    import torch.distributed as dist

    client = store if store is not None else dist.TCPStore(
        launch.master_addr, launch.master_port, launch.world_size, False, timedelta(seconds=30))
    client.add(_LEFT_KEY, 1)
    if store is None:
        return
    deadline = time.monotonic() + _LEAVE_WAIT_S
    while client.add(_LEFT_KEY, 0) < launch.world_size and time.monotonic() < deadline:
        time.sleep(0.005)


def _exit(code: int) -> None:
    """Exit without C++ static destructors.

    Python's atexit handlers run (a recipe's wandb.finish, say), stdio is
    flushed, then the process ends. Skipping interpreter teardown avoids a
    known class of aborts ("terminate called without an active exception")
    when gloo/TCPStore threads are destroyed after the store's host has gone,
    and saves most of a second per process.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _tensorboard(writer: EventWriter, spec: JobSpec, launch: LaunchEnv, ps_task: bool) -> Any:
    """``--tensorboard``: rank 0 writes into the folder, each ps task into ps<N> under it."""
    from distrun.runtime._tensorboard import TensorBoardTap

    board = spec.observe.tensorboard_dir
    assert board is not None
    logdir = f"{board}/ps{launch.rank - spec.strategy.replicas}" if ps_task else board
    tap = TensorBoardTap(writer, logdir)
    atexit.register(tap.close)  # _exit runs atexit handlers: the last figures reach the file
    return tap


def _profile_window(spec: JobSpec, launch: LaunchEnv, device: Any, writer: Any) -> Any:
    """``--profile``: this rank's window of steps (None without the flag)."""
    if spec.observe.profile_steps is None:
        return None
    from distrun.runtime._profile import ProfileWindow

    folder = spec.observe.profile_dir or os.path.join(os.getcwd(), "distrun-profile")
    window = ProfileWindow(spec.observe.profile_steps, folder, launch.rank, device.type, writer)
    atexit.register(window.close)  # _exit runs atexit handlers: a job that stops inside the window keeps its trace
    return window


def _trackers(writer: Any, spec: JobSpec, launch: LaunchEnv) -> Any:
    """``--tracker mlflow|wandb``: rank 0 logs the run; a tracker that cannot start fails the job here."""
    from distrun.runtime.tracking import tracker_tap

    tap = tracker_tap(writer, spec, world_size=launch.world_size, tf_config=os.environ.get("TF_CONFIG"))
    atexit.register(tap.close)  # _exit runs atexit handlers: the checkpoint is logged, each run ends
    tap.end_runs_on_sigterm()  # stopped by the launcher: each run ends as failed, not left running
    return tap


def _device(spec: JobSpec, launch: LaunchEnv) -> Any:
    import torch

    if spec.strategy.device == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError("device cuda asked for, but torch sees no GPU on this host")
        torch.cuda.set_device(launch.local_rank)
        return torch.device("cuda", launch.local_rank)
    return torch.device("cpu")


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


def _rendezvous_store(launch: LaunchEnv) -> Any:
    """Rank 0 hosts the TCPStore on the socket the launcher bound for it.

    Every rank (and a plain script's ``init_process_group()``) connects as a
    client, because the launcher sets TORCHELASTIC_USE_AGENT_STORE.
    """
    if launch.store_fd is None:
        return None
    import torch.distributed as dist

    return dist.TCPStore(
        launch.master_addr, launch.master_port, launch.world_size, True, _STORE_TIMEOUT,
        wait_for_workers=False, master_listen_fd=launch.store_fd,
    )


def _loop_options(spec: JobSpec) -> Any:
    """``strategy.options``: the job's options a loop acts on, for a custom loop to read."""
    from distrun.strategies.base import LoopOptions

    training, checkpoint = spec.training, spec.checkpoint
    return LoopOptions(steps=training.steps, epochs=training.epochs, global_batch_size=training.global_batch_size,
                       seed=training.seed, eval_every=training.eval_every, checkpoint_dir=checkpoint.dir,
                       checkpoint_every=checkpoint.every, keep=checkpoint.keep, resume=checkpoint.resume,
                       clip_grad_norm=training.clip_grad_norm, accumulate=training.accumulate,
                       args=tuple(training.args))


def _before_custom_loop(strategy: Any, spec: JobSpec, reporter: EventReporter) -> None:
    """What a fit recipe gets, for ``main(strategy)`` too: the seed set (the same initial parameters on
    every replica and under every strategy), ``--steps`` as the live view's total, and the "resumed
    from ... at step N" line when the loop restores a checkpoint."""
    import torch

    torch.manual_seed(spec.training.seed)
    total = spec.training.steps
    reporter.total_steps = total
    if strategy.is_chief:
        strategy.on_restored = lambda step, path: reporter.resumed(
            step, path, past_end=total is not None and step >= total)


def _make_strategy(spec: JobSpec, launch: LaunchEnv, device: Any, reporter: EventReporter, store: Any) -> Any:
    import torch.distributed as dist

    from distrun.strategies import ReplicaInfo, StepSettings, make_strategy

    if spec.precision.compile:
        from distrun.strategies.step.compile import use_cache_dir

        use_cache_dir(os.environ.get(CACHE_DIR_VAR))
    options: dict[str, Any] = {}
    rank, world_size = launch.rank, launch.world_size
    if spec.strategy.elastic:  # the first round's group is the default group; rank and size are the round's
        elastic = _join_elastic(spec, launch, device)
        if elastic.round is not None:  # a joiner joins in prepare(), once its model is built
            rank, world_size = elastic.round.rank, elastic.round.world_size
        options["elastic"] = elastic
    elif spec.strategy.name.collective:
        client = _store_client(launch)
        backend = "nccl" if device.type == "cuda" else "gloo"
        world_size = spec.trainer_ranks if spec.ps.tasks else world_size  # --embeddings ps: the group leaves ps tasks out
        dist.init_process_group(backend, store=client, rank=launch.rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
    name, parallel, communication = spec.strategy.name, spec.parallel, spec.communication
    model_parallel = parallel.ranks_per_replica > 1
    if name.value in ("mirrored", "multi-worker") and not model_parallel:
        options |= {"sync_batch_norm": spec.strategy.sync_batch_norm, "compression": communication.compression_spec,
                   "powersgd_warmup": communication.powersgd_warmup, "allreduce": communication.allreduce}
    if name is StrategyName.SHARDED or model_parallel:  # model parallel is built on sharded's FSDP2
        sharded = name is StrategyName.SHARDED
        options |= {"reshard_after_forward": spec.sharding.reshard_after_forward and sharded,
                    "shard_within": spec.sharding.within, "offload": spec.sharding.offload == "cpu",
                    "hosts": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                    "async_checkpoint": spec.checkpoint.asynchronous}
        if model_parallel:
            options |= {"tp": parallel.tp, "pp": parallel.pp, "pp_schedule": parallel.pp_schedule,
                        "microbatches": parallel.pipeline_microbatches, "sequence_parallel": parallel.sequence_parallel,
                        "loss_parallel": parallel.loss_parallel}
    if spec.strategy.embeddings == "ps":  # the hybrid: the tables' ps tasks, as parameter-server reaches them
        from distrun.runtime._ps_task import ps_wire_dtype

        options |= {"embeddings": "ps", "store": _store_client(launch), "num_ps": spec.ps.tasks,
                    "secret": job_secret_from(os.environ), "partition_bytes": spec.ps.partition_bytes,
                    "wire": ps_wire_dtype(spec)}
    if name is StrategyName.DILOCO:
        diloco = spec.diloco
        options |= {"sync_every": diloco.sync_every, "outer_lr": diloco.outer_lr,
                    "outer_momentum": diloco.outer_momentum, "sync_dtype": diloco.sync_dtype,
                    "fragments": diloco.fragments}
    if name is StrategyName.PARAMETER_SERVER:  # the workers are the replicas; ps tasks are not
        world_size = spec.strategy.replicas
        from distrun.runtime._ps_task import ps_wire_dtype

        options = {"store": _store_client(launch), "num_ps": spec.ps.tasks, "sync": spec.ps.sync,
                   "secret": job_secret_from(os.environ),
                   "partition_bytes": spec.ps.partition_bytes, "wire": ps_wire_dtype(spec)}
    replica = ReplicaInfo(rank=rank, world_size=world_size, local_rank=launch.local_rank,
                          device=device, seed=spec.training.seed, node_rank=launch.node_rank)
    step = StepSettings(precision=spec.precision.name, compile=spec.precision.compile,
                        compile_mode=spec.precision.compile_mode, clip_grad_norm=spec.training.clip_grad_norm,
                        activation_checkpointing=parallel.activation_checkpointing,
                        accumulate=spec.training.accumulate)
    return make_strategy(name.value, replica, reporter, step=step, **options)


def _join_elastic(spec: JobSpec, launch: LaunchEnv, device: Any) -> Any:
    """``--elastic``: this replica's membership, its first round joined (its group is the default group).

    The store is hosted by the launcher's agent process, not by rank 0: it outlives any rank.
    """
    from distrun.strategies.elastic.replica import Elastic
    from distrun.strategies.elastic.membership import Membership

    joiner = os.environ.get(ELASTIC_JOINER_VAR) == "1"
    membership = Membership(lambda: _store_client(launch), None if joiner else launch.rank, timeout=_STORE_TIMEOUT,
                            backend="nccl" if device.type == "cuda" else "gloo",
                            device=device if device.type == "cuda" else None, who=_who(launch),
                            launch_rank=launch.rank, incarnation=incarnation_id())
    ps_tasks = spec.ps.tasks if spec.strategy.embeddings == "ps" else 0  # --embeddings ps: ps tasks are no members
    elastic = Elastic(membership, min_members=spec.strategy.elastic_min, max_members=spec.strategy.elastic_max,
                      expect=launch.world_size - ps_tasks)
    if not joiner:
        elastic.first_round()
    return elastic


def _who(launch: LaunchEnv) -> str:
    """"rank 2 on 10.0.0.3": how membership events name this process (TF_CONFIG knows its host)."""
    import json

    try:
        host = json.loads(os.environ.get("TF_CONFIG", "{}"))["cluster"]["worker"][launch.rank].rsplit(":", 1)[0]
    except (KeyError, IndexError, ValueError, TypeError):
        host = os.environ.get(CHIEF_ADDR_VAR, launch.master_addr)
    return f"rank {launch.rank} on {host}"


def _store_client(launch: LaunchEnv) -> Any:
    """A client of the job's TCPStore (rank 0 hosts it): for the process group, or where
    parameter-server connections are numbered."""
    import torch.distributed as dist

    return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, False, _STORE_TIMEOUT)
