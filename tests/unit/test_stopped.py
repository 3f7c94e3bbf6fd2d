"""A rank stopped by a signal is found by its state, and said lost once (launch/_stopped)."""

import signal
import subprocess
import time

from distrun.launch._stopped import StoppedWatch, is_stopped


def test_a_stopped_process_is_lost_after_the_threshold_and_said_once():
    child = subprocess.Popen(["sleep", "30"])
    try:
        watch = StoppedWatch(lost_after_s=1.0)
        assert not is_stopped(child.pid) and watch.check({3: child.pid}, now=0.0) == []
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not is_stopped(child.pid):
            assert time.monotonic() < deadline, "the child never showed state T"
            time.sleep(0.01)
        assert watch.check({3: child.pid}, now=1.0) == []  # first seen stopped now
        assert watch.check({3: child.pid}, now=1.6) == []  # not yet a second
        assert watch.check({3: child.pid}, now=2.2) == [(3, "stopped by a signal for 1 s")]
        assert watch.check({3: child.pid}, now=9.0) == []  # said once
        child.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while is_stopped(child.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert watch.check({3: child.pid}, now=10.0) == []
    finally:
        child.kill()
        child.wait()
    assert not is_stopped(child.pid)  # gone: not stopped
