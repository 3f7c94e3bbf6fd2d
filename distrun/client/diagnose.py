"""Looking inside a running job: ``distrun stacks`` and what ``--hang-timeout-s`` prints.

Every host's launcher reads its ranks' stacks (py-spy) and, on a hang, asks each rank for
its Flight Recorder (``launch/local``); the dumps come home beside the job's results, and
one Diagnosed event says it all (``client/_diagnosis``, drawn by ``ui/diagnosis``).
"""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from distrun.client._diagnosis import build_diagnosis
from distrun.client._links import HostLink
from distrun.client.jobs import job_hosts, list_jobs
from distrun.config import ClusterSpec
from distrun.errors import HostError, UsageError
from distrun.launch import LocalLauncher
from distrun.protocol import Diagnosed
from distrun.protocol.diagnosis import RankStack

__all__ = ["diagnose_launcher", "diagnose_hosts", "cluster_stacks", "running_job"]

#: What a dump a server names may be called (``protocol.diagnosis.flight_recorder_file``).
_DUMP_NAME = re.compile(r"^flight-recorder-rank-\d{1,7}\.json$")
#: The most a dump may weigh when it comes home (torch's ring of 2000 entries is ~1 MB).
MAX_DUMP_BYTES = 64 << 20


#: How long ``distrun stacks`` waits for a host's answer: its ranks' Flight Recorder dumps (up to
#: 10 s for a rank stuck holding the GIL) and py-spy on each rank; a local job's server asks its
#: own `distrun train`, which has 30 s (``server/_local_job.DIAGNOSE_TIMEOUT_S``).
DIAGNOSE_WAIT_S = 45.0

def diagnose_launcher(launcher: LocalLauncher, reason: str, *, native: bool = False,
                      flight_recorder: bool = True, host: str = "localhost") -> Diagnosed:
    """A job of this machine: the dumps stay where the ranks wrote them (the job's debug folder)."""
    dumps: dict[tuple[int, str], bytes | None] = {}
    folder = None
    if flight_recorder:
        written = launcher.dump_flight_recorder()  # first: the ring as it was at the hang
        stacks = launcher.stacks(native=native, host=host)
        for stack in stacks:
            path = written.get(stack.rank)
            dumps[(stack.rank, host)] = Path(path).read_bytes() if path else None
        folder = str(Path(next(iter(written.values()))).parent) if written else None
    else:
        stacks = launcher.stacks(native=native, host=host)
    return build_diagnosis(reason, stacks, dumps, folder)


def diagnose_hosts(links: list[HostLink], job_id: str, reason: str, *, native: bool = False,
                   dest: Path | None = None) -> Diagnosed:
    """Every host of a cluster job at once; with ``dest``, each rank's Flight Recorder dump
    is brought home into it (named by rank), else none is asked for."""
    with ThreadPoolExecutor(max_workers=min(32, len(links) or 1)) as pool:
        answers = list(pool.map(lambda link: _ask(link, job_id, native, dest), links))
    stacks = [stack for found, _dumps in answers for stack in found]
    dumps = {key: raw for _found, host_dumps in answers for key, raw in host_dumps.items()}
    return build_diagnosis(reason, stacks, dumps, str(dest) if dest is not None and dumps else None)


def _ask(link: HostLink, job_id: str, native: bool, dest: Path | None) -> tuple[list[RankStack], dict[tuple[int, str], bytes | None]]:
    try:
        answer = link.call_waiting("diagnose", DIAGNOSE_WAIT_S, job=job_id, native=native,
                                   flight_recorder=dest is not None)
    except HostError as exc:
        return [RankStack(rank=-1, host=link.label, pid=0, error=exc.reason)], {}
    stacks = [dataclasses.replace(RankStack.from_dict(raw), host=link.label) for raw in answer.get("stacks") or ()]
    dumps: dict[tuple[int, str], bytes | None] = {}
    if dest is not None:
        written = answer.get("dumps") or {}
        for stack in stacks:
            path = written.get(str(stack.rank))
            dumps[(stack.rank, link.label)] = _fetch_dump(link, path, dest) if isinstance(path, str) else None
    return stacks, dumps


def _fetch_dump(link: HostLink, remote_path: str, dest: Path) -> bytes | None:
    name = PurePosixPath(remote_path).name
    if not _DUMP_NAME.match(name):
        raise HostError(link.label, f"the server named a dump distrun does not write: {name[:80]!r}")
    data = link.remote.read_bytes(remote_path)
    if len(data) > MAX_DUMP_BYTES:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    (dest / name).write_bytes(data)
    return data


def running_job(cluster: ClusterSpec) -> str:
    """The one job running on the cluster (``distrun stacks`` without JOB)."""
    running = [row.job for row in list_jobs(cluster) if row.state == "running"]
    if len(running) == 1:
        return running[0]
    if not running:
        raise UsageError("no job is running on the cluster; `distrun jobs` lists them")
    raise UsageError(f"{len(running)} jobs are running ({', '.join(running[:5])}): name one")


def cluster_stacks(cluster: ClusterSpec, job_id: str, *, native: bool = False,
                   dest: Path | None = None) -> Diagnosed:
    with job_hosts(cluster, job_id) as holders:
        return diagnose_hosts(holders, job_id, "asked", native=native, dest=dest)
