"""The sampling side of a rollout worker (seed 004), without Ray: an actor the one builder makes, the newest
weights it was told about (loaded at fragment boundaries only), a bounded queue of finished fragments, and
the pipeline monitor. A transport drains the queue in a thread of its own
(:class:`orchestration.ray_fleet.RolloutWorker`: ``ray.put`` and a push to every learner), so no remote call
happens inside the sampling loop, and a slow consumer fills the queue and so blocks sampling (back-pressure).

Usage loop (what the transport's process does)::

    sampler = Sampler(config, slot, incarnation, weights, fetch=load_weights, queue_size=8, threads=1)
    # consumer thread: item = sampler.queue.get(); deliver (fragment, meta, episodes) items; an Event item
    #   is a flush: set it once everything before it was delivered; on failure set sampler.error
    sampler.collect(num_fragments, weights)    # synchronous mode: returns once all were delivered
    sampler.run(weights) ... sampler.stop()     # asynchronous mode: streams until stopped (with ``credit``: a
                                                #   fragment per credit, orchestration.sampling_credit)
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Mapping

import torch

from orchestration.allocator import keep_freed_memory
from orchestration.builder import assignment_for, build_actor, policy_module, worker_id_of
from orchestration.collection_env import make_actor_env, switch_member_, tag_fragment
from orchestration.config import TrainConfig
from orchestration.past_selves import past_selves_report
from orchestration.statistics import PipelineMonitor, TimedEnv
from orchestration.wire import to_wire

#: policy id -> (version, [handles of its weights]) as the transport passes them; ``fetch`` loads one.
Weights = Mapping[str, tuple[int, list]]


class Sampler:
    """One rollout worker's sampling loop (module docstring): builds its envs and policies from ``config``
    and starts from ``weights``; ``slot`` is its place in the fleet and ``incarnation`` how often the slot
    was re-created. ``fetch(handle)`` loads weights (it raises one of ``fetch_errors`` when they are gone:
    the actor keeps acting with what it has); ``service`` (optional) makes every policy a stand-in asking
    that inference service (central inference); ``credit(timeout_s)`` (optional) takes one credit of the
    fleet's pool (:mod:`orchestration.sampling_credit`) before each streamed fragment, False when none came."""

    def __init__(self, config: TrainConfig, slot: int, incarnation: int, weights: Weights, *,
                 fetch: Callable[[Any], Any], queue_size: int, threads: int, fetch_errors: tuple = (),
                 service=None, credit: Callable[[float], bool] | None = None) -> None:
        torch.set_num_threads(threads)
        keep_freed_memory()
        self.slot, self.incarnation = slot, incarnation
        self.worker_id = worker_id_of(slot, incarnation)
        self.monitor = PipelineMonitor()
        rc = config.rollout
        self._polling = rc.env_polling
        self.env = TimedEnv(make_actor_env(config, rc.num_envs))  # a collection's members: one at a time
        tree = self.env.tree
        assignment = assignment_for(config, tree)
        policies = {pid: policy_module(config, tree, assignment, pid) for pid in weights}
        if service is not None:  # central inference: stand-ins that ask the service
            from orchestration.service_policy import ServicePolicy

            policies = {pid: ServicePolicy(pid, service, p) for pid, p in policies.items()}
        self.actor = build_actor(config, self.env, policies, assignment, slot=slot, incarnation=incarnation)
        self._fetch, self._fetch_errors, self._credit = fetch, fetch_errors, credit
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.produced = self.sent = self.push_failures = 0
        self._latest: dict[str, tuple[int, list]] = {}
        self._lock, self._loading = threading.Lock(), threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        """Set by the consumer thread when it fails; the sampling loop raises it at its next step."""
        self._delay = 0.0
        self._forced: set[str] = set()
        self._streaming = False
        self._next_env: str | None = None  # a collection member to switch to at the next fragment boundary
        self.set_latest(weights)
        self._load(force=service is None)  # a shared service may act with newer ones already: not turned back

    # -- weights -----------------------------------------------------------------------------------------
    def set_latest(self, weights: Weights, force: bool = False) -> None:
        """Records newer weights refs; the sampling loop loads them at its next fragment boundary.

        Versions only move forward (calls to a threaded actor may run out of order), unless ``force`` (a
        restored checkpoint may hold a version number again with other weights).
        """
        with self._lock:
            for pid, (version, refs) in weights.items():
                if force or int(version) > self._latest.get(pid, (-1,))[0]:
                    self._latest[pid] = (int(version), list(refs))
                    self._forced |= {pid} if force else set()

    def _load(self, force: bool = False) -> None:
        with self._lock:
            latest, forced, self._forced = dict(self._latest), self._forced, set()
        with self._loading:
            for pid, (version, refs) in latest.items():
                if force or pid in forced or version != self.actor.versions[pid]:
                    try:
                        weights = self._fetch(refs[0])
                    except self._fetch_errors:  # its learner died with the object: keep acting, newer come
                        continue
                    self.actor.set_weights(pid, version, weights, force=force or pid in forced)

    def sync_weights(self, weights: Weights, force: bool = False, timeout_s: float = 300.0) -> dict[str, int]:
        """Has the actor act with ``weights`` before it produces another fragment; returns the versions held.

        An idle worker loads them now; a streaming one at its current fragment's end (never mid-fragment):
        this call returns once the sampling loop has loaded them.
        """
        self.set_latest(weights, force)
        if not self._streaming:
            self._load()
        else:
            deadline = time.monotonic() + timeout_s
            while any(self.actor.versions[pid] < v for pid, (v, _) in weights.items()) or self._forced:
                if time.monotonic() > deadline or self._stop.is_set():
                    break
                time.sleep(0.002)
        return dict(self.actor.versions)

    # -- sampling loop (one thread) ----------------------------------------------------------------------
    def _produce(self) -> None:
        """One fragment: newest weights, ``fragment_length`` steps, assembly, then into the queue."""
        self._check_sender()
        self._load()
        if self._next_env is not None:
            env_id, self._next_env = self._next_env, None
            switch_member_(self.actor, env_id)
        actor, monitor = self.actor, self.monitor
        start, env_before = time.perf_counter(), self.env.elapsed
        if self._polling:  # the next stream's fragment: steps and assembly interleave
            fragment = actor.collect()
            stepped = time.perf_counter()
        else:
            with torch.no_grad():
                for _ in range(actor.fragment_length):
                    actor.step()
            stepped = time.perf_counter()
            fragment = actor.build_fragment()
        if self._delay:
            time.sleep(self._delay)  # a slow environment (test hook)
        episodes = tag_fragment(actor.completed_episodes(), self.env)
        built = time.perf_counter()
        env_time = self.env.elapsed - env_before + self._delay
        monitor.add("env_step", env_time)
        monitor.add("inference", stepped - start - env_time)
        monitor.add("assembly", built - stepped)
        meta = {**actor.fragment_meta(fragment), "slot": self.slot, "incarnation": self.incarnation}
        self.produced += 1
        self._put((fragment, meta, episodes))
        monitor.add("enqueue_wait", time.perf_counter() - built)
        monitor.fragment_built(meta["env_steps"], self.queue.qsize())

    def _put(self, item) -> None:
        while True:
            try:
                return self.queue.put(item, timeout=0.1)
            except queue.Full:
                self._check_sender()

    def _check_sender(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"worker {self.worker_id}: the sender thread failed") from self.error

    def _flush(self) -> None:
        """Blocks until every queued fragment was delivered and acknowledged."""
        done = threading.Event()
        self._put(done)
        while not done.wait(0.1):
            self._check_sender()
        self._check_sender()

    def set_env_id(self, env_id: str | None) -> None:
        """Acts in collection member ``env_id`` from the next fragment boundary on (None: no change)."""
        if env_id is not None:
            self._next_env = env_id

    def collect(self, num_fragments: int, weights: Weights, env_id: str | None = None) -> dict[str, Any]:
        """Synchronous mode: ``num_fragments`` fragments with ``weights`` (in collection member ``env_id``),
        delivered before returning."""
        self.set_env_id(env_id)
        self.set_latest(weights)
        for _ in range(num_fragments):
            self._produce()
        self._flush()
        return self.report()

    def run(self, weights: Weights, env_id: str | None = None) -> dict[str, Any]:
        """Asynchronous mode: streams fragments (in collection member ``env_id``) until :meth:`stop`; delivers
        what it built, then returns."""
        self.set_env_id(env_id)
        self.set_latest(weights)
        self._streaming = True
        try:
            while not self._stop.is_set():
                if self._credited():
                    self._produce()
                else:  # between fragments, waiting for credit: weights handed over meanwhile load now (a
                    self._load()  # sync_weights waits for them, and the training that frees credit may wait for it)
        finally:
            self._streaming = False
        self._flush()
        return self.report()

    def _credited(self) -> bool:
        """Whether the next fragment may start: a credit taken (waits up to 0.1 s for one, so that a stop is
        seen), or no credit pool."""
        if self._credit is None:
            return True
        start = time.perf_counter()
        got = self._credit(0.1)
        self.monitor.add("credit_wait", time.perf_counter() - start)
        return got

    def stop(self) -> None:
        """Ends :meth:`run` after the current fragment."""
        self._stop.set()

    # -- checkpoints -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The actor's :meth:`orchestration.actor.Actor.state` (synchronous mode: taken between collects)."""
        return self.actor.state()

    def load_state_(self, state: Mapping[str, Any]) -> dict[int, int]:
        """Loads a :meth:`state`; returns the restored fragment counts (worker id -> fragments built)."""
        self.actor.load_state_(state)
        return self.actor.sequences()

    # -- reports and test hooks --------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Fragments produced and sent by this incarnation, and the pipeline monitor's window (then reset)."""
        return {"worker_id": self.worker_id, "slot": self.slot, "incarnation": self.incarnation,
                "produced": self.produced, "produced_by": self.actor.sequences(), "sent": self.sent, "push_failures": self.push_failures,
                "monitor": self.monitor.snapshot(reset=True), "env_counters": dict(getattr(self.env, "counters", {})),
                "past_selves": past_selves_report(self.actor)}

    def policy_weights(self, policy_id: str) -> dict:
        """The weights this worker acts with for ``policy_id`` (wire form)."""
        with self._loading:
            return to_wire(self.actor.policy_weights(policy_id))

    def set_fragment_delay(self, seconds: float) -> None:
        """Sleeps ``seconds`` in every fragment, like a slow environment (tests of staleness)."""
        self._delay = float(seconds)


__all__ = ["Sampler", "Weights"]
