"""The rollout side on Ray (seed 004): :class:`RolloutWorker`, a :class:`orchestration.sampler.Sampler` whose
sender thread ``ray.put``s each fragment in wire form and pushes the ref to every learner (at most
``max_in_flight`` unacknowledged per learner: a slow learner blocks sampling), and :class:`RayFleet`, the Fleet
protocol of :mod:`orchestration.fleet` over those workers. Weights arrive as one ref per version. Sync: each worker
collects its share with the current weights, dead workers' losses re-collected; async: workers stream on credits
(:mod:`orchestration.sampling_credit`). A dead worker comes back as a new incarnation (new worker id and seeds;
incarnation 0's are the local backend's, so a sync Ray run reproduces a local one). Central inference: one
threaded :class:`InferenceServer` actor, proxied by :class:`RemoteService`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import ray
from tensordict import TensorDictBase

from orchestration.builder import stream_worker_ids
from orchestration.config import RayConfig, TrainConfig
from orchestration.fleet import collect_in_rounds, one_per_worker, resume_gaps, worker_states_saved
from orchestration.inference import InferenceResult
from orchestration.ray_session import kill_actor, try_get
from orchestration.sampler import Sampler
from orchestration.sampling_credit import CreditLedger, CreditPool, batch_fragments
from orchestration.statistics import EpisodeStatistics
from orchestration.user_errors import users_mistake_within
from orchestration.wire import from_wire, to_wire


#: policy id -> (version, [ref of its wire-form weights]); the ref is nested so Ray passes it unresolved.
Weights = Mapping[str, tuple[int, list]]


class RolloutWorker(Sampler):
    """One rollout process (module docstring): fragments to every learner in ``learners``, episodes to ``stats``;
    ``inference``: the central inference server, ``credits``: the fleet's credit pool (streaming), if any."""

    def __init__(self, config: TrainConfig, ray_config: RayConfig, slot: int, incarnation: int,
                 learners: Mapping[str, Any], stats, weights: Weights, inference=None, credits=None) -> None:
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


@dataclass
class _Slot:
    slot: int
    incarnation: int
    handle: Any
    run_ref: Any = None


class RayFleet:
    """Creates, drives and re-creates ``config.rollout.num_workers`` rollout workers (driver side; no data).
    ``learners`` (policy id -> actor handle) and ``stats`` go to every worker, ``weights`` start them (TensorDicts
    are put once per version); ``consumers``: the learners whose trainings give credit back (async mode)."""

    def __init__(self, config: TrainConfig, ray_config: RayConfig, learners: Mapping[str, Any], stats,
                 weights: Weights, inference=None, consumers: int = 1) -> None:
        self.config, self.ray_config, self.inference = config, ray_config, inference
        self.learners, self.stats = dict(learners), stats
        self._puts: dict[str, tuple[int, list]] = {}
        weights = self._refs(weights)
        self.fragment_steps = config.rollout.fragment_steps
        self.restarts = 0
        self.reported: dict[int, int] = {}  # worker id -> fragments produced, as last reported
        self.dead: set[int] = set()  # worker ids of incarnations that died
        self.env_ids: list[str | None] = [None] * config.rollout.num_workers  # collection member per slot
        self._collecting = False
        self.credits = self._ledger = None  # asynchronous mode: the credit pool actor and the driver's ledger
        if config.mode == "async":
            fragments = batch_fragments(config.steps_per_iteration, self.fragment_steps)
            self.credits = RemoteCreditPool.remote(fragments, config.max_staleness)
            self._ledger = CreditLedger(keep=64 * fragments, consumers=consumers)
        self.slots = [self._spawn(i, 0, weights) for i in range(config.rollout.num_workers)]
        try:  # construction errors surface here
            self._env_state = all(info["env_state"] for info in ray.get([s.handle.info.remote() for s in self.slots]))
        except BaseException as err:
            for slot in self.slots:
                kill_actor(slot.handle)
            if (mistake := users_mistake_within(err)) is not None:  # an env's first observation, say
                raise mistake from None
            raise

    def _spawn(self, slot: int, incarnation: int, weights: Weights) -> _Slot:
        options: dict[str, Any] = {"num_cpus": self.ray_config.worker_num_cpus, "max_restarts": 0,
                                   "num_gpus": self.ray_config.worker_num_gpus}
        if self.ray_config.worker_strategy == "SPREAD":
            options["scheduling_strategy"] = "SPREAD"
        handle = RemoteRolloutWorker.options(**options).remote(self.config, self.ray_config, slot, incarnation,
                                                                self.learners, self.stats, weights, self.inference,
                                                                self.credits)
        return _Slot(slot, incarnation, handle)

    def restart(self, index: int, weights: Weights, cause: BaseException | None = None) -> None:
        """Replaces the worker in slot ``index`` by a new incarnation started from ``weights``; only a dead one:
        an error its code or envs raised ends the run, as on the local backend (the user's mistake as itself)."""
        if (mistake := users_mistake_within(cause)) is not None:
            raise mistake from None
        if _raised_by_worker(cause):  # its code or its envs raised: the run ends there, as on the local backend
            raise cause
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
        """At least ``target_steps`` env steps acted with ``weights``; the reports (:func:`collect_in_rounds`)."""
        weights = self._refs(weights)
        self._collecting = True  # stays set if this raises: the workers' states may be mid-fragment

        def run_rounds(requests: dict[int, int]) -> list[dict]:
            pending = {self.slots[i].handle.collect.remote(k, weights, self.env_ids[i]): i
                       for i, k in requests.items() if k}
            reports = []
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                index = pending.pop(done[0])
                try:
                    reports.append(ray.get(done[0]))
                except ray.exceptions.RayError as err:
                    self.restart(index, weights, err)  # raises the user's mistake instead
                    continue
                self._record(reports[-1])
            return reports

        reports = collect_in_rounds(target_steps, self.fragment_steps, len(self.slots), run_rounds, new_steps,
                                    attempts=self.ray_config.max_worker_restarts + 2)
        self._collecting = False
        return reports

    # -- asynchronous mode -------------------------------------------------------------------------------
    def start(self, weights: Weights) -> None:
        """Starts every worker streaming."""
        weights = self._refs(weights)
        for slot in self.slots:
            slot.run_ref = slot.handle.run.remote(weights, self.env_ids[slot.slot])

    def broadcast(self, weights: Weights, wait: bool = False, force: bool = False) -> None:
        """New weights refs to every worker, loaded at its next fragment boundary (``wait``: by all, now)."""
        weights = self._refs(weights)
        if wait:
            ray.get([slot.handle.sync_weights.remote(weights, force) for slot in self.slots])
            return
        for slot in self.slots:
            slot.handle.set_latest.remote(weights, force)

    def set_env_ids(self, env_ids) -> None:
        """Collection member per worker, from its next fragment boundary."""
        self.env_ids = one_per_worker(self.config, env_ids, len(self.slots))
        for slot in self.slots:
            if slot.run_ref is not None:
                slot.handle.set_env_id.remote(self.env_ids[slot.slot])

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
            self.slots[index].run_ref = self.slots[index].handle.run.remote(weights, self.env_ids[index])
        return len(done)

    def pump(self, weights: Weights, hungry: bool = False) -> None:
        """Async mode: replaces dead workers, tops the credit pool up when due (``hungry``), waits a moment."""
        self.check(weights)
        if self._ledger is not None and self._ledger.top_up_due(hungry):
            self.credits.top_up.remote()
        time.sleep(self.ray_config.poll_interval_s)

    def trained(self, fragment_ids, learner: str = "") -> None:
        """Async mode: the credit ``learner`` freed by training on ``fragment_ids`` goes back to the pool."""
        if self._ledger is not None and (returned := self._ledger.returned(fragment_ids, learner)):
            self.credits.grant.remote(returned)

    def episodes(self) -> dict[str, Any]:
        try:  # EpisodeStatistics.drain
            return ray.get(self.stats.drain.remote())
        except ray.exceptions.RayActorError:  # its node died: it restarts empty, the episodes it held are gone
            return {"episodes": {}, "summary": {}}

    def actor_weights(self, policy_id: str) -> list:
        """The weights every worker acts with for ``policy_id``."""
        return [from_wire(m) for m in ray.get([s.handle.policy_weights.remote(policy_id) for s in self.slots])]

    @property
    def resume_gaps(self) -> list[str]:
        return resume_gaps(self.config, self._env_state, self.restarts)

    def state(self) -> list[dict]:
        """Every worker's actor state, or ``[]`` (:func:`worker_states_saved`; a worker that does not answer)."""
        if not worker_states_saved(self.config, self.restarts, self._collecting):
            return []
        try:
            return ray.get([s.handle.state.remote() for s in self.slots])
        except ray.exceptions.RayError:
            return []

    def load_state_(self, states) -> None:
        """Inverse of :meth:`state` (the produced counts follow the workers' sequence numbers)."""
        if states and worker_states_saved(self.config, self.restarts, self._collecting):
            for counts in ray.get([s.handle.load_state_.remote(st) for s, st in zip(self.slots, states)]):
                self.reported.update(counts)

    def monitors(self, timeout: float = 0.5) -> list[dict]:
        """Reports of the workers answering within ``timeout`` (served beside sampling; others skipped)."""
        refs = [s.handle.report.remote() for s in self.slots]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        reports = [r for r in map(try_get, ready) if r is not None]
        for report in reports:
            self._record(report)
        return reports

    def interrupt(self) -> None:
        """Nothing to give up: collections end by themselves (a hung env: ``rollout.env_timeout_s``)."""

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
        for handle in [*(s.handle for s in self.slots), self.stats, *filter(None, [self.inference, self.credits])]:
            kill_actor(handle)


def _raised_by_worker(err: BaseException | None) -> bool:
    """Whether a worker's call failed because the worker's code raised (a Ray task error carrying a Python
    exception), not because its process, a node or an object of Ray's was lost."""
    return isinstance(err, ray.exceptions.RayTaskError) and not isinstance(err.cause, ray.exceptions.RayError)


#: The statistics actor: light (no CPU reserved), made remote once.
RemoteEpisodeStatistics = ray.remote(num_cpus=0)(EpisodeStatistics)

#: The credit pool: an async actor (waiting workers hold no thread).
RemoteCreditPool = ray.remote(num_cpus=0)(CreditPool)


class RemoteService:
    """A rollout worker's handle on the server: the :class:`ActionService` methods, each call waiting."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._sent: dict[str, int] = {}

    @property
    def versions(self) -> dict[str, int]:
        """Versions this worker handed over (the server dedups; asking it per step would cost a round trip)."""
        return dict(self._sent)

    def act(self, policy_id: str, obs: Any, **kwargs: Any) -> InferenceResult:
        return ray.get(self.handle.act.remote(policy_id, obs, kwargs))

    def set_weights(self, policy_id: str, version: int, weights: TensorDictBase, force: bool = False) -> None:
        ray.get(self.handle.set_weights.remote(policy_id, version, to_wire(weights), force))
        self._sent[policy_id] = version

    def weights(self, policy_id: str) -> TensorDictBase:
        return from_wire(ray.get(self.handle.weights.remote(policy_id)), copy=True)


__all__ = ["RayFleet", "RemoteEpisodeStatistics", "RemoteRolloutWorker", "RemoteService", "RolloutWorker", "Weights"]
