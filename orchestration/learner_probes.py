"""Probes of a hosted learner (:class:`orchestration.learner_host.LearnerHost` mixes them in, so the Ray learner
actor has them): calls that tests and debugging make to look inside a remote learner, or to break it. Plain
Python, no Ray."""

from __future__ import annotations

import os
import time
from typing import Any

from orchestration.data_parallel import check_in_sync
from orchestration.wire import to_wire


class LearnerProbes:
    """For a host whose ``learner`` is a :class:`orchestration.learner.PPOLearner` that keeps its last batch
    (``keep_last_batch``) and whose ``_peers`` are its data-parallel ranks."""

    learner: Any
    _peers: list

    def trained_counts(self) -> dict[int, int]:
        """Fragment id -> times trained on (the newest 100k fragments trained)."""
        return dict(self.learner.inbox.trained)

    def last_batch(self) -> list[dict]:
        """The fragments of the last training step, as wire messages."""
        return [to_wire(e.fragment, e.meta) for e in self.learner.last_batch]

    def pooled_memory(self) -> dict[str, Any]:
        """Addresses of each pooled fragment's first leaf and this process's memory map (tests: one copy)."""
        with open("/proc/self/maps") as f:
            maps = f.read()
        return {"addresses": [next(iter(e.fragment.values(True, True))).data_ptr()
                              for e in self.learner.inbox.pool.values()], "maps": maps}

    def crash(self) -> None:
        """Ends this process at once, as a fatal error would (tests of learner restarts)."""
        os._exit(1)

    def pause(self, seconds: float) -> None:
        """Blocks the learner for ``seconds`` (tests: a slow learner, pushes pile up behind it)."""
        time.sleep(seconds)

    def peer_handles(self) -> list:
        """The data-parallel ranks beside this one (rank 0)."""
        return list(self._peers)

    def in_sync(self) -> bool:
        """Whether this rank's parameters equal every other rank's."""
        return check_in_sync(self.learner.policy)


__all__ = ["LearnerProbes"]
