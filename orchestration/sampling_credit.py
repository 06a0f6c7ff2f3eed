"""Credit-based flow control for streaming rollout workers (asynchronous mode on Ray): how many fragments the
fleet may still produce before the learners have trained on what it already made.

Without it, workers that sample faster than the learners train fill every queue between them, and by the time a
queued fragment is trained on, the policy that made it lags by more than ``max_staleness`` versions: it is dropped
(counted ``stale``), the env steps and the CPU that made it wasted. The pool starts with enough credit for
``max_staleness + 1`` batches (one being trained on, the next ones filling meanwhile); each fragment a worker
starts takes one credit; a fragment gives it back once every learner it went to is done with it (trained on it, or
dropped it as stale). So the fleet runs at most that many batches ahead of its slowest learner, and a fast worker
takes the credit a slow one leaves (one pool for all, not a share each). A learner still short of data while
workers wait (fragments lost, never made by a worker that died, or held by a learner that died, or by drops that a
starved learner reports only with its next training) is topped up after a while: one credit per waiting worker.

Usage loop (the fleet owns the pool; in a Ray actor, workers ask it across processes)::

    pool = CreditPool(batch_fragments=4, max_staleness=1)     # credit for 8 fragments
    # worker, before each fragment:   while not await pool.acquire(0.1): check for stop
    # driver, after each training:    await pool.grant(ledger.returned(fragment_ids, learner))
    # driver, while a learner waits:  if ledger.top_up_due(hungry): await pool.top_up()
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from typing import Callable, Iterable


#: How long a learner waits for data, with no training in between, before the pool is topped up (data in
#: flight arrives sooner; what does not is lost, and its credit never comes back).
TOP_UP_AFTER_S = 0.5


class CreditLedger:
    """The driver's side of the pool: what a training result gives back, and when a learner waiting for data calls
    for a top-up (``TOP_UP_AFTER_S`` with no training and no top-up).

    Every fragment goes to each of ``consumers`` learners. Its credit comes back when the last of them is done with
    it: had the first given it back, a fast learner would let the workers make fragments that the slower one gets
    too late (stale). Reuse trains a learner on a fragment several times: counted once. The newest ``keep`` ids are
    remembered. ``clock``: seconds, monotonic."""

    def __init__(self, keep: int, consumers: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep, self.consumers, self._clock = keep, max(1, consumers), clock
        self._done: OrderedDict[int, set[str]] = OrderedDict()  # fragment id -> learners done with it
        self._since = clock()

    def returned(self, fragment_ids: Iterable[int], learner: str = "") -> int:
        """Credits given back when ``learner`` is done with ``fragment_ids`` (trained on them, or dropped them)."""
        self._since = self._clock()
        new = 0
        for fid in fragment_ids:
            done = self._done.setdefault(fid, set())
            if learner not in done:
                done.add(learner)
                new += len(done) == self.consumers
        while len(self._done) > self.keep:
            self._done.popitem(last=False)
        return new

    def top_up_due(self, hungry: bool) -> bool:
        """Whether to top the pool up now: a learner is ``hungry`` and nothing was trained for a while."""
        if not hungry or self._clock() - self._since < TOP_UP_AFTER_S:
            return False
        self._since = self._clock()
        return True


def batch_fragments(steps_per_iteration: int, fragment_steps: int) -> int:
    """Fragments that make one training batch."""
    return max(1, math.ceil(steps_per_iteration / fragment_steps))


class CreditPool:
    """The fleet's credit (module docstring); asyncio methods, so that a Ray actor serves many waiting workers.

    Args:
        batch_fragments: fragments that make one training batch.
        max_staleness: versions a fragment may lag when trained; the pool holds ``max_staleness + 1`` batches.
    """

    def __init__(self, batch_fragments: int, max_staleness: int) -> None:
        self.capacity = (max_staleness + 1) * batch_fragments
        self.balance = self.capacity
        self.waiting = 0
        self.counters = {"acquired": 0, "returned": 0, "topped_up": 0}
        self._changed: asyncio.Condition | None = None  # made in the loop that serves the pool

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def acquire(self, timeout_s: float) -> bool:
        """Takes one credit, waiting up to ``timeout_s`` for one; False when none came (ask again)."""
        changed = self._condition()
        deadline = time.monotonic() + timeout_s
        async with changed:
            self.waiting += 1
            try:
                while self.balance <= 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    try:
                        await asyncio.wait_for(changed.wait(), left)
                    except asyncio.TimeoutError:
                        return False
            finally:
                self.waiting -= 1
            self.balance -= 1
            self.counters["acquired"] += 1
            return True

    async def grant(self, fragments: int) -> None:
        """Gives back the credit of ``fragments`` trained on (never above the capacity)."""
        changed = self._condition()
        async with changed:
            self.balance = min(self.capacity, self.balance + fragments)
            self.counters["returned"] += fragments
            changed.notify_all()

    async def top_up(self) -> int:
        """A learner is short of data: one credit per worker waiting, if the pool is empty; returns how many."""
        changed = self._condition()
        async with changed:
            if self.balance > 0 or not self.waiting:
                return 0
            given = self.waiting
            self.balance += given
            self.counters["topped_up"] += given
            changed.notify_all()
            return given

    def state(self) -> dict:
        """Balance, capacity, workers waiting and the counters."""
        return {"balance": self.balance, "capacity": self.capacity, "waiting": self.waiting, **self.counters}


__all__ = ["TOP_UP_AFTER_S", "CreditLedger", "CreditPool", "batch_fragments"]
