"""How the inference service's threads wait (:mod:`orchestration.inference`): a caller for its answer
(:class:`Answer`, resolved by :func:`hand_back`), the service thread for more requests (:func:`get_within`)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any


class Answer:
    """A one-shot answer for a caller that waits at once (:meth:`InferenceService.act`): the part of the
    ``Future`` API the service uses, on a lock taken at creation and released by the answer. A ``Future``
    waits on a condition variable, which costs every answer a second lock and a notify."""

    __slots__ = ("_lock", "_value", "_error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._value: Any = None
        self._error: BaseException | None = None

    def set_running_or_notify_cancel(self) -> bool:
        return True  # nobody can cancel it: its caller is waiting for it

    def set_result(self, value: Any) -> None:
        self._value = value
        self._lock.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._lock.release()

    def done(self) -> bool:
        return not self._lock.locked()

    def result(self, timeout: float | None = None) -> Any:
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("no answer from the inference service in time")
        self._lock.release()
        if self._error is not None:
            raise self._error
        return self._value


def hand_back(answers: list) -> None:
    """Resolves the futures of ``answers`` (``(future, result or error)`` pairs), emptying it."""
    for future, value in answers:
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)
    answers.clear()


def get_within(waiting: queue.SimpleQueue, seconds: float, poll_s: float = 50e-6):
    """The next item of ``waiting`` within ``seconds`` (real time), by short sleeps between non-blocking gets;
    raises ``queue.Empty`` after that. Never ``SimpleQueue.get(timeout=...)`` where other threads consume too:
    in CPython it blocks for good when another consumer takes the item whose put woke it and the deadline
    passes before the woken thread runs again (its remaining time turns negative, read as "no timeout")."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return waiting.get_nowait()
        except queue.Empty:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(left, poll_s))


__all__ = ["Answer", "get_within", "hand_back"]
