"""SIGTERM for the ``shoal`` command: where the training loop does not handle it (starting up, waiting for the
first simulator, a league's set-up), a supervisor's SIGTERM unwinds the run as Ctrl-C does, so launched
simulators, env processes and Ray are released and the run ends with one line (exit 143).

Usage (the console entry point only: a library caller keeps its own handlers)::

    stop_on_sigterm()
    try:
        run()
    except Terminated:
        ...                                     # one line, exit 143
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable


class Terminated(KeyboardInterrupt):
    """SIGTERM where nothing else handles it: unwinds as Ctrl-C does."""


def _terminate(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second one must not cut the clean-up short
    raise Terminated


def _default_in_child() -> None:
    if signal.getsignal(signal.SIGTERM) is _terminate:  # a forked env worker dies of SIGTERM, as before
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def stop_on_sigterm() -> None:
    """Makes SIGTERM raise :class:`Terminated` in this process (main thread); forked children keep the default.
    A SIGINT ignored since the process started (a script's background job) raises KeyboardInterrupt again: the
    training loop takes SIGINT over anyway, and one sent while starting up was lost."""
    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.register_at_fork(after_in_child=_default_in_child)


@contextlib.contextmanager
def kept_sigterm():
    """Keeps a SIGTERM handler this process installed across a call that installs its own (``ray.init``); the
    default one it may replace. Main thread only, where handlers live."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if previous not in (None, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, previous)


class StopAfterIteration:
    """SIGINT / SIGTERM in a training loop (``shoal train``, ``serve``, ``league``): the first one is noted in
    :attr:`signal` and the loop ends after the current iteration (with a checkpoint: no learner is saved halfway
    through an update), or at once where the iteration waits for data that may not come (``on_signal``: the
    trainers' :meth:`~orchestration.trainer.Trainer.interrupt`); a second SIGINT interrupts at once. Main thread
    only (elsewhere no handler is installed)."""

    def __init__(self, on_signal: Callable[[], None] = lambda: None) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._on_signal = on_signal

    def __enter__(self) -> StopAfterIteration:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test runner's worker): no handlers
                pass
        return self

    def _handle(self, sig: int, frame) -> None:
        if self.signal is not None and sig == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = sig
        self._on_signal()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C and SIGTERM are ignored in the block (main thread; elsewhere nothing changes): a clean-up that an
    interrupt started (saving what was trained, waiting for players to end their iteration) is not cut short
    by a second one, which would leave a checkpoint half written or a player's games unrecorded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler installed outside Python, which Python cannot restore
                signal.signal(sig, handler)


@contextlib.contextmanager
def held_interrupts():
    """Ctrl-C is held (blocked) in the block and delivered when it ends (main thread, POSIX; elsewhere nothing
    changes), and processes started inside inherit the block. Around ``ray.init``: a terminal's Ctrl-C reaches
    the whole process group, and one while a local Ray instance started killed this process mid-start; its
    raylet died with it (fate-shared) and the raylet's agents stayed behind for a minute. Held, it interrupts
    the run once Ray is up, which then shuts down in order."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


__all__ = ["StopAfterIteration", "Terminated", "deferred_interrupts", "held_interrupts", "kept_sigterm",
           "stop_on_sigterm"]
