"""Messages exchanged between distrun's processes: dataclasses and their JSON wire form."""

from distrun.protocol.events import (
    Checkpointed,
    Done,
    Eval,
    Event,
    EventDecodeError,
    Exited,
    Failed,
    Log,
    PEER_LOST,
    Output,
    Started,
    Step,
    decode_event,
    encode_event,
    event_to_dict,
)
from distrun.protocol.snapshot import JobSnapshot, JobSummary, ReplicaRow, ReplicaStatus

__all__ = [
    "Event",
    "Started",
    "Step",
    "Log",
    "Eval",
    "Checkpointed",
    "Output",
    "Failed",
    "Done",
    "Exited",
    "PEER_LOST",
    "EventDecodeError",
    "encode_event",
    "decode_event",
    "event_to_dict",
    "JobSnapshot",
    "JobSummary",
    "ReplicaRow",
    "ReplicaStatus",
]
