"""One job's state from its hosts' states, and what to blame when it failed.

Each host's server records its own part of a job; ``distrun jobs`` shows one row.
The merge is a fixed order, strongest first, so the answer never depends on which
host answered first:

    running > pending > (a state this client does not know) > failed > preempted
            > stopped > succeeded > lost

* still running anywhere: ``running``;
* ``failed`` beats ``stopped``: since a cancel is decided on every host before any
  rank is killed (``launch/_stop``), a host records ``failed`` only for a failure of
  the job's own, from before the cancel; a host that was merely stopped with it says
  ``stopped``;
* ``preempted`` beats ``stopped`` (the others stopped with the checkpointed ones) but
  not ``failed``;
* ``stopped`` beats ``succeeded``: a job cancelled as it finished was still cancelled;
* ``lost`` (``--elastic``: a host lost for good, the others went on) is the weakest.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from distrun.protocol import OOM_KILLED, EventDecodeError, Failed, decode_event
from distrun.protocol.root_cause import root_cause

__all__ = ["STATE_ORDER", "merge_states", "blame", "blamed_host", "host_failures", "host_words",
           "failure_message", "as_written", "unshipped_hint"]

STATE_ORDER = ("running", "pending", "failed", "preempted", "stopped", "succeeded", "lost")
#: Just after pending: a newer server's state is shown, not hidden behind "failed".
_UNKNOWN = 1.5
#: A server unpacks each bundle in bundles/<sha256>/: a recipe's path there, as the user wrote it.
_IN_BUNDLE = re.compile(r"^.*/bundles/[0-9a-f]{64}/")
#: The path a FileNotFoundError names ("No such file or directory: 'data/x.txt'").
_MISSING = re.compile(r"No such file or directory: '([^']+)'")


def merge_states(states: Iterable[str]) -> str:
    """The job's state from each host's (see the module's order); "unknown" for none."""
    strength = {state: index for index, state in enumerate(STATE_ORDER)}
    found = list(states)
    if not found:
        return "unknown"
    return min(found, key=lambda state: strength.get(state, _UNKNOWN))


def failure_message(failure: Failed | None) -> str:
    """One failed rank in one line: where in the recipe, which rank, at which step, what."""
    if failure is None:
        return "training failed"
    where = f"{failure.file}:{failure.line}: " if failure.file else ""
    at_step = f" while {failure.during}" if failure.during else f" at step {failure.step}" if failure.step else ""
    if failure.kind == OOM_KILLED:  # "exit -9", answered: "rank 1 was killed by the kernel's out-of-memory killer"
        return f"{where}rank {failure.rank} was {failure.message}"
    return f"{where}rank {failure.rank} failed{at_step}: {failure.message}"


def blame(parts: Iterable[tuple[str, Mapping[str, Any]]]) -> str | None:
    """One line naming a failed job's root cause from (host, its ``jobs`` entry) pairs, by the rule
    the live view's also follows (``protocol/root_cause``), so both blame the same host. None when
    no host recorded a failure."""
    entries = dict(parts)
    blamed = blamed_host(entries.items())
    if blamed is None:
        return None
    host, failure = blamed
    return f"{host}: {host_words(entries[host]) if failure is None else failure_message(as_written(failure))}"


def blamed_host(parts: Iterable[tuple[str, Mapping[str, Any]]]) -> tuple[str, Failed | None] | None:
    """The (host, its rank's ``Failed`` or None) that ``root_cause`` blames among (host, its recorded
    result) pairs: ``distrun jobs`` and a cluster job's outcome and restart line ask the same."""
    return root_cause(host_failures(parts))


def host_words(entry: Mapping[str, Any]) -> str:
    """A host's failure in its own words, where no rank's ``Failed`` names it: the message of a failure
    this client cannot decode (a server of another version's), else the host's error."""
    raw = entry.get("failure")
    if raw:
        said = raw.get("message") if isinstance(raw, dict) else None
        return str(said or "failed")
    return str(entry.get("error") or "failed")


def host_failures(parts: Iterable[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, Failed | None]]:
    """Each host's recorded failure, for ``root_cause``: (host, its rank's ``Failed``), or (host, None)
    for a host that broke, or that recorded a failure this client cannot decode (another version's)."""
    records: list[tuple[str, Failed | None]] = []
    for host, entry in parts:
        raw = entry.get("failure")
        if raw:
            try:
                event = decode_event(json.dumps(raw))
            except EventDecodeError:
                event = None
            records.append((host, event if isinstance(event, Failed) else None))
        elif entry.get("error"):
            records.append((host, None))
    return records


def as_written(failure: Failed) -> Failed:
    """The recipe's path inside the host's bundle folder, as the user wrote it."""
    return dataclasses.replace(failure, file=_IN_BUNDLE.sub("", failure.file)) if failure.file else failure


def unshipped_hint(message: str, recipe: str | None) -> str:
    """A rank could not find a file of its bundle that is there beside the recipe on this machine
    (data the recipe reads from its own folder): how to ship it, or "" when that is not the case.
    ``message``: the rank's error (not its traceback, whose frames name the recipe's own path)."""
    found = _MISSING.search(message) if recipe is not None else None
    if found is None:
        return ""
    missing = found.group(1)
    inside = _IN_BUNDLE.match(missing)
    if inside is not None:  # an absolute path into the host's bundle folder
        name = missing[inside.end():]
    elif not missing.startswith("/"):  # relative: a rank's folder is its bundle's root
        name = missing[2:] if missing.startswith("./") else missing
    else:
        return ""
    if not name or ".." in name.split("/"):
        return ""
    here = Path(recipe).resolve().parent / name  # type: ignore[arg-type]
    if not here.exists():
        return ""
    return (f"; {name} is next to the recipe here but was not shipped: add include = [{name!r}] to "
            f"{Path(recipe).name}, or pass --include {here}")
