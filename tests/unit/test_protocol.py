import json

import pytest

from distrun.protocol import Done, EventDecodeError, Failed, Step, decode_event, encode_event
from distrun.protocol.events import MAX_EVENT_BYTES


@pytest.mark.parametrize(
    "event",
    [
        Step(rank=1, time=1.5, step=3, epoch=0, loss=0.25, samples_per_s=10.0, mem_mb=5.0, total_steps=9),
        Failed(rank=0, time=2.0, kind="raised", message="ValueError: x", file="/r.py", line=4, step=2),
        Done(rank=0, time=3.0, steps=9, final_loss=None, samples_per_s=1.0, first_step_time=None),
    ],
)
def test_round_trip(event):
    line = encode_event(event)
    assert line.endswith(b"\n") and json.loads(line)["type"] == event.type
    assert decode_event(line) == event


@pytest.mark.parametrize(
    "line, fragment",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"type": "evil", "rank": 0, "time": 0}', "unknown event type"),
        (b'{"type": "exited", "rank": 0, "time": 0, "returncode": 0, "extra": 1}', "unknown fields"),
        (b'{"type": "exited", "rank": 0}', "exited event"),
    ],
)
def test_rejects_malformed_lines(line, fragment):
    with pytest.raises(EventDecodeError, match=fragment):
        decode_event(line)


def test_rejects_oversized_lines_before_parsing():
    with pytest.raises(EventDecodeError, match="exceeds"):
        decode_event(b"{" + b" " * MAX_EVENT_BYTES + b"}")
