"""The inference service's wait for more requests (orchestration.inference_requests.get_within)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from orchestration.inference_requests import get_within


def test_a_timed_wait_ends_when_another_consumer_takes_its_wake_up():
    """The hang of issue 13's benchmark: the service thread waits at most ``max_wait_s`` for more requests; a
    put wakes it, but a helping caller (``serve_queued``) takes the item first and keeps the interpreter past
    the wait's deadline. CPython's ``SimpleQueue.get(timeout=...)`` then waits for ever (its remaining time
    turns negative, read as "no timeout"), and so did every caller whose request the service thread held."""
    for _ in range(20):
        waiting: queue.SimpleQueue = queue.SimpleQueue()
        ended = threading.Event()

        def wait_for_more() -> None:
            with pytest.raises(queue.Empty):
                get_within(waiting, 0.002)
            ended.set()

        waiter = threading.Thread(target=wait_for_more, daemon=True)
        waiter.start()
        time.sleep(0.0005)
        waiting.put("request")
        waiting.get_nowait()  # another consumer takes it before the woken waiter runs
        spin_until = time.monotonic() + 0.01  # and holds the interpreter past the waiter's deadline
        while time.monotonic() < spin_until:
            pass
        assert ended.wait(2.0), "the timed wait never ended"


def test_a_timed_wait_returns_an_item_that_comes_in_time():
    waiting: queue.SimpleQueue = queue.SimpleQueue()
    threading.Timer(0.01, waiting.put, args=("request",)).start()
    assert get_within(waiting, 5.0) == "request"
    with pytest.raises(queue.Empty):
        get_within(waiting, 0.001)
