"""A rollout worker on Ray (seed 004): a :class:`orchestration.sampler.Sampler` plus a sender thread that
``ray.put``s each fragment in wire form and pushes the ref to every learner, at most ``max_in_flight``
unacknowledged per learner (a slow learner blocks sampling: back-pressure). Weights arrive as one ref per version.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Mapping

import ray

from orchestration.config import RayConfig, TrainConfig
from orchestration.sampler import Sampler
from orchestration.wire import from_wire, to_wire

#: policy id -> (version, [ref of its wire-form weights]); the ref is nested so Ray passes it unresolved.
Weights = Mapping[str, tuple[int, list]]


class RolloutWorker(Sampler):
    """One rollout process (module docstring): fragments to every learner in ``learners``, episodes to ``stats``;
    ``inference``: the central inference server, ``credits``: the fleet's credit pool (streaming), if any."""

    def __init__(self, config: TrainConfig, ray_config: RayConfig, slot: int, incarnation: int,
                 learners: Mapping[str, Any], stats, weights: Weights, inference=None, credits=None) -> None:
        from orchestration.ray_fleet import RemoteService

        self.construction_error: Exception | None = None
        self._credits, self._asked = credits, None
        try:
            super().__init__(config, slot, incarnation, weights, fetch=lambda ref: from_wire(ray.get(ref)),
                             fetch_errors=(ray.exceptions.RayError,), queue_size=ray_config.queue_size,
                             threads=ray_config.worker_threads,
                             service=RemoteService(inference) if inference is not None else None,
                             credit=self._credit if credits is not None else None)
        except Exception as err:  # an env that fails its first reset, say: Ray would keep only the error's text
            self.construction_error = err  # (an ActorDiedError); the first call raises it as itself
            return
        self.ray_config = ray_config
        self.learners, self.stats = dict(learners), stats
        self._sender = threading.Thread(target=self._send_loop, name="fragment-sender", daemon=True)
        self._sender.start()

    # -- sender thread -----------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        inflight: deque = deque()
        side: list = []  # episode-statistics calls, awaited only on flush
        limit = self.ray_config.max_in_flight * max(len(self.learners), 1)
        while True:
            item = self.queue.get()
            try:
                if isinstance(item, threading.Event):
                    for ref in inflight:
                        self._acknowledged(ref)
                    ray.get(side)
                    inflight.clear()
                    side = []
                    item.set()
                    continue
                fragment, meta, episodes = item
                start = time.perf_counter()
                ref = ray.put(to_wire(fragment, meta))
                put = time.perf_counter()
                inflight.extend(learner.push.remote(meta, [ref]) for learner in self.learners.values())
                if episodes and self.stats is not None:
                    side.append(self.stats.add.remote(meta["worker_id"], meta["sequence"], episodes))
                while len(inflight) > limit:
                    self._acknowledged(inflight.popleft())
                if len(side) > 8:
                    side = ray.wait(side, num_returns=len(side), timeout=0)[1]
                self.sent += 1
                self.monitor.add("serialize_put", put - start)
                self.monitor.add("send_wait", time.perf_counter() - put)
                self.monitor.fragment_sent()
            except BaseException as err:  # surfaced to the sampling loop by _check_sender
                self.error = err
                if isinstance(item, threading.Event):
                    item.set()

    def _credit(self, timeout_s: float) -> bool:
        """One credit for the next fragment; the one after is asked for at once (its answer travels meanwhile)."""
        asked, self._asked = self._asked or self._credits.acquire.remote(timeout_s), None
        try:
            got = ray.get(asked)
        except ray.exceptions.RayError:  # the pool is gone (the run is closing): no flow control
            return True
        if got:
            self._asked = self._credits.acquire.remote(timeout_s)
        return got

    def _acknowledged(self, ref) -> None:
        """Waits for one push; a learner that died meanwhile counts the gap as lost when back: sampling goes on."""
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            self.push_failures += 1

    def _built(self) -> None:
        if self.construction_error is not None:
            raise self.construction_error

    def collect(self, num_fragments: int, weights: Weights, env_id: str | None = None) -> dict[str, Any]:
        self._built()
        return super().collect(num_fragments, weights, env_id)

    def run(self, weights: Weights, env_id: str | None = None) -> dict[str, Any]:
        self._built()
        return super().run(weights, env_id)

    def info(self) -> dict[str, Any]:
        """Worker id, node id, process id, whether its envs save their state (or its construction's error)."""
        self._built()
        return {"worker_id": self.worker_id, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "env_state": hasattr(self.actor.env, "state_dict")}

#: The rollout worker actor: threaded, so control calls (weights refs, monitor, stop) run beside sampling.
RemoteRolloutWorker = ray.remote(max_concurrency=4)(RolloutWorker)


__all__ = ["RemoteRolloutWorker", "RolloutWorker", "Weights"]
