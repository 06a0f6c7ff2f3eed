"""The rollout fleet on Ray (seed 004): rollout workers, their sender threads, and the manager over them.

A :class:`RolloutWorker` (plain class, made remote once) wraps the actor the one builder makes
(:func:`orchestration.builder.build_actor`).
Its sampling loop puts fragments in a bounded queue; a sender thread ``ray.put``s each in wire form
(:mod:`orchestration.wire`) and pushes the ref to every learner, with at most ``max_in_flight``
unacknowledged pushes per learner: a slow learner fills the queue and blocks sampling (back-pressure),
and no RPC happens inside the sampling loop. At each fragment boundary the worker loads the newest weights
it was told about (one ref per version, put once by the learner); each fragment records its versions.

:class:`RayFleet` (driver side) implements the Fleet protocol (:mod:`orchestration.fleet`): it creates,
supervises and re-creates workers. Synchronous mode: each worker
collects its share of ``train_batch_size`` with the current weights (seed 000); what dead workers lost is
re-collected. Asynchronous mode: workers stream until stopped and get new weights refs as published. A dead
worker is re-created as a new incarnation (new ``worker_id``, new seed stream) and re-synced. Incarnation 0
has the local backend's worker ids and seeds: a synchronous Ray run reproduces a local run bit for bit.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ray
import torch
from tensordict import TensorDictBase

from orchestration.builder import assignment_for, build_actor, policy_module, stream_worker_ids, worker_id_of
from orchestration.config import RayConfig, TrainConfig
from orchestration.envs import make_run_env
from orchestration.ray_session import kill_actor, try_get
from orchestration.statistics import EpisodeStatistics, PipelineMonitor, TimedEnv
from orchestration.wire import from_wire, to_wire

#: policy id -> (version, [ref of its wire-form weights]); the ref is nested so Ray passes it unresolved.
Weights = Mapping[str, tuple[int, list]]


class RolloutWorker:
    """One rollout process: a local :class:`Actor`, a bounded fragment queue and a sender thread.

    Builds its envs and policies from ``config`` and starts from ``weights``; ``slot`` is its place in the
    fleet and ``incarnation`` how often the slot was re-created. Every fragment goes to every learner in
    ``learners`` (policy id -> handle); completed episodes go to ``stats`` (or nowhere when None).
    """

    def __init__(self, config: TrainConfig, ray_config: RayConfig, slot: int, incarnation: int,
                 learners: Mapping[str, Any], stats, weights: Weights, inference=None) -> None:
        torch.set_num_threads(ray_config.worker_threads)
        self.ray_config, self.slot, self.incarnation = ray_config, slot, incarnation
        self.worker_id = worker_id_of(slot, incarnation)
        self.monitor = PipelineMonitor()
        rc = config.rollout
        self._polling = rc.env_polling
        self.env = TimedEnv(make_run_env(config, rc.num_envs))
        tree = self.env.tree
        assignment = assignment_for(config, tree)
        policies = {pid: policy_module(config, tree, assignment, pid) for pid in weights}
        if inference is not None:  # central inference: stand-ins that ask the server actor
            from orchestration.ray_inference import RemoteService
            from orchestration.service_policy import ServicePolicy

            remote = RemoteService(inference)
            policies = {pid: ServicePolicy(pid, remote, p) for pid, p in policies.items()}
        self.actor = build_actor(config, self.env, policies, assignment, slot=slot, incarnation=incarnation)
        self.learners, self.stats = dict(learners), stats
        self.queue: queue.Queue = queue.Queue(maxsize=ray_config.queue_size)
        self.produced = self.sent = self.push_failures = 0
        self._latest: dict[str, tuple[int, list]] = {}
        self._lock, self._loading = threading.Lock(), threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._delay = 0.0
        self._forced: set[str] = set()
        self._streaming = False
        self.set_latest(weights)
        self._load(force=True)
        self._sender = threading.Thread(target=self._send_loop, name="fragment-sender", daemon=True)
        self._sender.start()

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
                        weights = from_wire(ray.get(refs[0]))
                    except ray.exceptions.RayError:  # its learner died with the object: keep acting, newer come
                        continue
                    self.actor.set_weights(pid, version, weights, force=True)

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
        episodes = actor.completed_episodes()
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
        if self._error is not None:
            raise RuntimeError(f"worker {self.worker_id}: the sender thread failed") from self._error

    def _flush(self) -> None:
        """Blocks until every queued fragment was delivered and acknowledged."""
        done = threading.Event()
        self._put(done)
        while not done.wait(0.1):
            self._check_sender()
        self._check_sender()

    def collect(self, num_fragments: int, weights: Weights) -> dict[str, Any]:
        """Synchronous mode: ``num_fragments`` fragments with ``weights``, delivered before returning."""
        self.set_latest(weights)
        for _ in range(num_fragments):
            self._produce()
        self._flush()
        return self.report()

    def run(self, weights: Weights) -> dict[str, Any]:
        """Asynchronous mode: streams fragments until :meth:`stop`; delivers what it built, then returns."""
        self.set_latest(weights)
        self._streaming = True
        try:
            while not self._stop.is_set():
                self._produce()
        finally:
            self._streaming = False
        self._flush()
        return self.report()

    def stop(self) -> None:
        """Ends :meth:`run` after the current fragment."""
        self._stop.set()

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
                self._error = err
                if isinstance(item, threading.Event):
                    item.set()

    def _acknowledged(self, ref) -> None:
        """Waits for one push; a learner that died meanwhile did not get it (it counts the gap as lost when it
        is back, see orchestration.ray_learner), so sampling goes on."""
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            self.push_failures += 1

    # -- reports and test hooks --------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """Fragments produced and sent by this incarnation, and the pipeline monitor's window (then reset)."""
        return {"worker_id": self.worker_id, "slot": self.slot, "incarnation": self.incarnation,
                "produced": self.produced, "produced_by": self.actor.sequences(), "sent": self.sent, "push_failures": self.push_failures,
                "monitor": self.monitor.snapshot(reset=True), "env_counters": dict(getattr(self.env, "counters", {}))}

    def info(self) -> dict[str, Any]:
        """Where this worker runs: worker id, node id, process id."""
        return {"worker_id": self.worker_id, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def policy_weights(self, policy_id: str) -> dict:
        """The weights this worker acts with for ``policy_id`` (wire form)."""
        with self._loading:
            return to_wire(self.actor.policy_weights(policy_id))

    def set_fragment_delay(self, seconds: float) -> None:
        """Sleeps ``seconds`` in every fragment, like a slow environment (tests of staleness)."""
        self._delay = float(seconds)


#: The rollout worker actor: threaded, so control calls (weights refs, monitor, stop) run beside sampling.
RemoteRolloutWorker = ray.remote(max_concurrency=4)(RolloutWorker)


@dataclass
class _Slot:
    slot: int
    incarnation: int
    handle: Any
    run_ref: Any = None

    @property
    def worker_id(self) -> int:
        return worker_id_of(self.slot, self.incarnation)


class RayFleet:
    """Creates, drives and re-creates ``config.rollout.num_workers`` rollout workers (driver side; no data).

    ``learners`` (policy id -> learner actor handle) and ``stats`` (an :class:`EpisodeStatistics` actor) are
    handed to every worker; ``weights`` start them. Weights handed over as TensorDicts (fixed policies, a
    league's opponent) are put in the object store once per version.
    """

    resume_exact = False
    """A resumed Ray run restarts its workers' envs (learners resume exactly; sampling does not)."""

    def __init__(self, config: TrainConfig, ray_config: RayConfig, learners: Mapping[str, Any], stats,
                 weights: Weights, inference=None) -> None:
        self.config, self.ray_config, self.inference = config, ray_config, inference
        self.learners, self.stats = dict(learners), stats
        self._puts: dict[str, tuple[int, list]] = {}
        weights = self._refs(weights)
        self.fragment_steps = config.rollout.fragment_steps
        self.restarts = 0
        self.reported: dict[int, int] = {}  # worker id -> fragments produced, as last reported
        self.dead: set[int] = set()  # worker ids of incarnations that died
        self.slots = [self._spawn(i, 0, weights) for i in range(config.rollout.num_workers)]
        ray.get([s.handle.info.remote() for s in self.slots])  # construction errors surface here

    def _spawn(self, slot: int, incarnation: int, weights: Weights) -> _Slot:
        options: dict[str, Any] = {"num_cpus": self.ray_config.worker_num_cpus, "max_restarts": 0}
        if self.ray_config.worker_strategy == "SPREAD":
            options["scheduling_strategy"] = "SPREAD"
        handle = RemoteRolloutWorker.options(**options).remote(self.config, self.ray_config, slot, incarnation,
                                                                self.learners, self.stats, weights, self.inference)
        return _Slot(slot, incarnation, handle)

    def restart(self, index: int, weights: Weights, cause: BaseException | None = None) -> None:
        """Replaces the worker in slot ``index`` by a new incarnation started from ``weights``."""
        old = self.slots[index]
        self.dead.update(stream_worker_ids(self.config, old.slot, old.incarnation))
        kill_actor(old.handle)
        if self.restarts >= self.ray_config.max_worker_restarts:
            raise RuntimeError(f"rollout worker restarts exhausted ({self.restarts})") from cause
        self.restarts += 1
        self.slots[index] = self._spawn(old.slot, old.incarnation + 1, weights)

    def _refs(self, weights: Weights) -> dict[str, tuple[int, list]]:
        """``weights`` with every TensorDict replaced by ``[ref]`` of its wire form (one put per version)."""
        out = {}
        for pid, (version, w) in weights.items():
            if isinstance(w, TensorDictBase):
                if self._puts.get(pid, (None,))[0] != version:
                    self._puts[pid] = (version, [ray.put(to_wire(w))])
                w = self._puts[pid][1]
            out[pid] = (version, w)
        return out

    def _record(self, report: Mapping[str, Any]) -> None:
        for wid, produced in report.get("produced_by", {report["worker_id"]: report["produced"]}).items():
            self.reported[wid] = max(self.reported.get(wid, 0), produced)

    # -- synchronous mode --------------------------------------------------------------------------------
    def collect(self, target_steps: int, weights: Weights, new_steps: Callable[[], int] | None) -> list[dict]:
        """Has the workers deliver at least ``target_steps`` env steps acting with ``weights``; their reports.

        Every worker collects the same number of fragments (rounds of one per worker, as the local fleet);
        if workers died, ``new_steps()`` (fresh steps the learners hold) tells what the live ones must add
        (None: nothing learns, nothing to top up).
        """
        weights = self._refs(weights)
        n = len(self.slots)
        rounds = math.ceil(target_steps / (self.fragment_steps * n))
        requests = dict.fromkeys(range(n), rounds)
        reports: list[dict] = []
        for _ in range(self.ray_config.max_worker_restarts + 2):
            pending = {self.slots[i].handle.collect.remote(k, weights): i for i, k in requests.items() if k}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                index = pending.pop(done[0])
                try:
                    report = ray.get(done[0])
                except ray.exceptions.RayError as err:
                    self.restart(index, weights, err)
                    continue
                self._record(report)
                reports.append(report)
            missing = target_steps - new_steps() if new_steps is not None else 0
            if missing <= 0:
                return reports
            share = math.ceil(math.ceil(missing / self.fragment_steps) / n)
            requests = dict.fromkeys(range(n), share)
        raise RuntimeError("could not collect a training batch")

    # -- asynchronous mode -------------------------------------------------------------------------------
    def start(self, weights: Weights) -> None:
        """Starts every worker streaming."""
        weights = self._refs(weights)
        for slot in self.slots:
            slot.run_ref = slot.handle.run.remote(weights)

    def broadcast(self, weights: Weights, wait: bool = False, force: bool = False) -> None:
        """Hands new weights refs to every worker, loaded at its next fragment boundary (fire-and-forget: a
        dead worker is found by :meth:`check`), or with ``wait`` loaded now by all before returning."""
        weights = self._refs(weights)
        if wait:
            ray.get([slot.handle.sync_weights.remote(weights, force) for slot in self.slots])
            return
        for slot in self.slots:
            slot.handle.set_latest.remote(weights, force)

    def check(self, weights: Weights) -> int:
        """Re-creates (and restarts streaming on) every worker whose ``run`` ended; returns how many."""
        weights = self._refs(weights)
        running = {s.run_ref: i for i, s in enumerate(self.slots) if s.run_ref is not None}
        done = ray.wait(list(running), num_returns=len(running), timeout=0)[0] if running else []
        for ref in done:
            index, cause = running[ref], None
            try:
                self._record(ray.get(ref))
            except ray.exceptions.RayError as err:
                cause = err
            self.restart(index, weights, cause)
            self.slots[index].run_ref = self.slots[index].handle.run.remote(weights)
        return len(done)

    def pump(self, weights: Weights) -> None:
        """Asynchronous mode: replaces dead workers, then leaves the workers a moment to produce."""
        self.check(weights)
        time.sleep(self.ray_config.poll_interval_s)

    def episodes(self) -> dict[str, Any]:
        """Episodes the statistics actor got since the last call (:meth:`EpisodeStatistics.drain`)."""
        try:
            return ray.get(self.stats.drain.remote())
        except ray.exceptions.RayActorError:  # its node died: it restarts empty, the episodes it held are gone
            return {"episodes": {}, "summary": {}}

    def actor_weights(self, policy_id: str) -> list:
        """The weights every worker acts with for ``policy_id``."""
        return [from_wire(m) for m in ray.get([s.handle.policy_weights.remote(policy_id) for s in self.slots])]

    def state(self) -> list[dict]:
        """Workers' envs are not checkpointed: a resumed Ray run restarts them."""
        return []

    def load_state_(self, states) -> None:
        """Nothing to restore (see :meth:`state`)."""

    def monitors(self, timeout: float = 0.5) -> list[dict]:
        """Reports of the workers answering within ``timeout`` (served beside sampling; others skipped)."""
        refs = [s.handle.report.remote() for s in self.slots]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        reports = [r for r in map(try_get, ready) if r is not None]
        for report in reports:
            self._record(report)
        return reports

    def stop(self, timeout: float = 60.0) -> None:
        """Ends streaming; waits until each worker delivered what it built (its final report)."""
        running = [s for s in self.slots if s.run_ref is not None]
        for slot in running:
            slot.handle.stop.remote()
        for slot in running:
            report = try_get(slot.run_ref, timeout)
            if report is None:
                self.dead.update(stream_worker_ids(self.config, slot.slot, slot.incarnation))
            else:
                self._record(report)
            slot.run_ref = None

    def alive(self, timeout: float = 5.0) -> int:
        """How many workers answer a call within ``timeout``."""
        return sum(try_get(ref, timeout) is not None for ref in [s.handle.info.remote() for s in self.slots])

    def handles(self) -> list:
        """The current worker handles, by slot."""
        return [s.handle for s in self.slots]

    def close(self) -> None:
        """Stops streaming; kills every worker and the statistics actor."""
        self.stop()
        for handle in [*(s.handle for s in self.slots), self.stats, *([self.inference] if self.inference else [])]:
            kill_actor(handle)


#: The statistics actor: light (no CPU reserved), made remote once.
RemoteEpisodeStatistics = ray.remote(num_cpus=0)(EpisodeStatistics)

__all__ = ["RayFleet", "RemoteEpisodeStatistics", "RemoteRolloutWorker", "RolloutWorker", "Weights"]
