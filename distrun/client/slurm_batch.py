"""``distrun export slurm``: the same job as one sbatch script, for users who submit jobs themselves.

The script asks for what the cluster file's ``slurm:`` section says, then
trains without the client: ``srun`` starts ``distrun node`` once per node (the
entrypoint ``export k8s`` uses too), which starts that node's ranks with
torchrun's environment and TF_CONFIG, exactly as a worker server would. The
recipe's bundle and the job spec are embedded in the script (so the laptop
still ships the code; the nodes hold none), written at run time into a 0700
folder under the submit directory, which Slurm clusters share between nodes
(the checkpoint folder has to be shared too).

Each run draws a fresh data-plane secret and hands it to the ranks through
srun's environment, never on a command line. Every value taken from the cluster
file or the flags is quoted with ``shlex``; the embedded files sit in quoted
heredocs, which the shell does not expand.
"""

from __future__ import annotations

import base64
import shlex
import textwrap
from dataclasses import dataclass, replace

from distrun._version import __version__
from distrun.client._bundle import Bundle
from distrun.config import ClusterSpec, JobSpec
from distrun.errors import UsageError
from distrun.protocol.environment import JOB_SECRET_VAR

__all__ = ["SlurmBatch", "sbatch_script", "BASE_PORT"]

#: Node 0's rendezvous port is BASE_PORT + job id % PORT_SPREAD: two jobs on one node differ.
BASE_PORT = 20000
PORT_SPREAD = 10000  # ports 20000-29999: below Linux's ephemeral range (32768 and up)
#: sbatch refuses scripts above 4 MiB by default (max_script_size); base64 grows the bundle by a third.
MAX_BUNDLE_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class SlurmBatch:
    cluster: ClusterSpec
    spec: JobSpec
    bundle: Bundle
    nodes: int  # nodes the job runs on (one for the single-host strategies)
    slots: int  # ranks per node
    job_name: str
    #: ``--requeue``: Slurm warns the script ``grace_s`` before the time limit (SIGUSR1); the
    #: ranks checkpoint at an agreed step and stop, and the script requeues the job, which
    #: resumes from that checkpoint.
    requeue: bool = False
    grace_s: int = 120


def sbatch_script(batch: SlurmBatch) -> str:
    cluster, spec, bundle = batch.cluster, batch.spec, batch.bundle
    slurm = cluster.slurm
    if slurm is None:
        raise UsageError(f"export slurm: {cluster.label} has no `scheduler: slurm` section to ask Slurm with")
    if bundle.size_bytes > MAX_BUNDLE_BYTES:
        raise UsageError(f"export slurm: the bundle is {bundle.size_bytes / 2**20:.1f} MiB; an sbatch script holds "
                         f"at most {MAX_BUNDLE_BYTES // 2**20} MiB of it (leave data out of the recipe's folder)")
    directives = [f"#SBATCH {_directive('--job-name=' + batch.job_name)}", "#SBATCH --output=%x-%j.out",
                  "#SBATCH --open-mode=append",
                  *(f"#SBATCH {_directive(arg)}" for arg in replace(slurm, nodes=batch.nodes).sbatch_args())]
    if batch.requeue:
        directives += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{batch.grace_s}"]
    python = shlex.quote(slurm.python)
    setup = "\n".join(f"srun --ntasks-per-node=1 sh -c {shlex.quote(command)}" for command in cluster.setup)
    env = "\n".join(f"export {key}={shlex.quote(value)}" for key, value in sorted(cluster.env.items()))
    checkpoint = ["--checkpoint-dir", spec.checkpoint.dir] if spec.checkpoint.dir else []
    requeue = ["--preempted-file", _Var("job_dir", "/preempted")] if batch.requeue else []
    node: list[str | _Var] = [
        slurm.python, "-m", "distrun", "node", "--bundle", _Var("job_dir", "/bundle.tar.gz"),
        "--spec", _Var("job_dir", "/spec.json"), "--recipe", bundle.recipe, "--nnodes", str(batch.nodes),
        "--nproc-per-node", str(batch.slots), "--master-addr", _Var("master"), "--master-port", _Var("port"),
        "--node-hosts", _Var("hosts"), "--run-id", _Var("SLURM_JOB_ID"), *checkpoint, *requeue]
    node_line = " ".join(word.shell() if isinstance(word, _Var) else shlex.quote(word) for word in node)
    step = f"srun --nodes={batch.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 {node_line}"
    launch = [step] if not batch.requeue else _REQUEUE.format(step=step).splitlines()
    payload = "\n".join(textwrap.wrap(base64.b64encode(bundle.data).decode(), 76))
    return "\n".join([
        "#!/bin/bash",
        *directives,
        f"# Written by `distrun export slurm` (distrun {__version__}): {bundle.recipe!r} under --strategy "
        f"{spec.strategy.name.value}, {batch.slots} rank(s) per node. Submit with `sbatch FILE`.",
        "set -euo pipefail",
        "umask 077",
        *(_WARNED if batch.requeue else []),
        'job_dir="$SLURM_SUBMIT_DIR/.distrun-jobs/$SLURM_JOB_ID"  # shared with every node',
        'mkdir -p "$job_dir"',
        "base64 -d > \"$job_dir/bundle.tar.gz\" <<'DISTRUN_BUNDLE'",
        payload,
        "DISTRUN_BUNDLE",
        "cat > \"$job_dir/spec.json\" <<'DISTRUN_SPEC'",
        spec.to_json(),
        "DISTRUN_SPEC",
        *([env] if env else []),
        *([setup] if setup else []),
        'hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
        'master=${hosts%%,*}',
        f"port=$(( {BASE_PORT} + SLURM_JOB_ID % {PORT_SPREAD} ))",
        f"{JOB_SECRET_VAR}=$({python} -c 'from distrun.protocol.secret import new_job_secret; "
        "print(new_job_secret())')",
        f"export {JOB_SECRET_VAR}  # to the ranks through srun's environment, never a command line",
        "export PYTHONUNBUFFERED=1",
        *launch,
        "",
    ])


@dataclass(frozen=True)
class _Var:
    """A variable the script itself sets (``$job_dir``), expanded in double quotes; any other word
    (paths, the recipe's name) is a literal for ``shlex.quote``, so nothing of the user's expands."""

    name: str
    suffix: str = ""

    def shell(self) -> str:
        return f'"${{{self.name}}}"{shlex.quote(self.suffix) if self.suffix else ""}'


#: Under ``--requeue``, before anything else: Slurm's warning may come while the bundle is being
#: written or setup runs; it is noted, and handed on once the step runs.
_WARNED = [
    'warned=0; signalled=0; step=""',
    'trap \'warned=1; signalled=1; [ -z "$step" ] || kill -USR1 "$step" 2>/dev/null\' USR1',
]

#: The run under ``--requeue``: a requeued run resumes; Slurm's SIGUSR1 goes on to every node's
#: ``distrun node`` (srun hands it on). A node whose ranks checkpointed and stopped writes
#: ``$job_dir/preempted`` before it exits 75; the ranks exit only after every rank's part of the
#: checkpoint is written, so the first such file means the checkpoint is whole, even when srun
#: (``--kill-on-bad-exit``) then ends the other nodes before they say so.
_REQUEUE = """\
rm -f "$job_dir/preempted"
resume=""
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then resume="--resume-if-any"; fi
set +e
{step} ${{resume:+"$resume"}} &
step=$!
if [ "$warned" = 1 ]; then kill -USR1 "$step" 2>/dev/null; fi
while :; do signalled=0; wait "$step"; code=$?; [ "$signalled" = 1 ] || break; done
if [ -e "$job_dir/preempted" ]; then
  echo "distrun: every rank checkpointed at Slurm's warning; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$code"
"""


def _directive(arg: str) -> str:
    """An option on an ``#SBATCH`` line: sbatch reads these itself (not a shell), honouring only
    double quotes and backslashes, so an argument with a space is double-quoted, escaped."""
    if not any(c.isspace() or c in '"\\' for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
