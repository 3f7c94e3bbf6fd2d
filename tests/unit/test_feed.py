"""The event feed: what reaches the user of a job, local or cluster."""

from __future__ import annotations

from distrun.client._feed import EventFeed
from distrun.client._tracker import JobTracker
from distrun.protocol import Output

C10D = "[W1123 03:46:18.479518416 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3"


def test_c10d_reverse_dns_warnings_become_one_note_for_the_whole_job():
    feed = EventFeed(JobTracker("r.py", "multi-worker", replicas=3))
    for rank in (0, 1, 2, 1):
        feed.put(Output(rank=rank, time=0.0, stream="stderr", line=C10D))
    feed.put(Output(rank=2, time=0.0, stream="stderr", line="epoch 1"))
    feed.end()
    lines = [event.line for event in feed.events(0.01) if event is not None]
    assert len(lines) == 2 and lines[1] == "epoch 1"
    assert lines[0].startswith("[distrun] no reverse DNS for the peers' addresses here") and "said once" in lines[0]


def test_a_job_in_its_own_network_drops_them_without_a_note():
    """A local job's private network has no DNS by design (launch/_netns): nothing to tell."""
    feed = EventFeed(JobTracker("r.py", "mirrored", replicas=2), own_network=True)
    for rank in (0, 1):
        feed.put(Output(rank=rank, time=0.0, stream="stderr", line=C10D))
    feed.put(Output(rank=1, time=0.0, stream="stderr", line="epoch 1"))
    feed.end()
    assert [event.line for event in feed.events(0.01) if event is not None] == ["epoch 1"]
