"""Batched inference service (seed 003): many callers ask one service for actions; it answers in batches.

A thread owned by the service forms a batch from the requests waiting, concatenates them along the batch
dim (on the CPU, then one copy per entry to the service's device: CUDA when present), runs ONE
:meth:`core.policies.GroupPolicy.act_step` per policy (two when one batch mixes deterministic and sampling
requests of a policy), splits the outputs back (CPU tensors) and resolves each caller's
:class:`concurrent.futures.Future`. The service acts with its own copies of the policies. Plain Python +
torch + threads: no Ray here (a Ray actor or the external-environment server may host it).

Usage loop::

    service = InferenceService({"agents": policy}, InferenceConfig(max_batch_rows=512, max_wait_s=0.001))
    service.start()
    # any number of threads, each for its own envs (any number of rows n, every request its own deadline):
    result = service.act("agents", {"observation": obs, "action_mask": legal}, timeout_s=1.0)
    env.step(result.action)              # [n, A, *act]; result.log_prob [n, A, 1]; result.version
    # or without blocking: future = service.submit(...); ...; result = future.result()
    # the learner, whenever it publishes (loaded between batches, never during one):
    service.set_weights("agents", version, weights)
    service.stats()                      # batches, rows per batch, drops, weight swaps
    service.close()                      # serves what is queued, then refuses (ServiceClosed)

Shapes of requests, batches and results: :mod:`orchestration.inference_requests`; weights swapped between
batches: :mod:`orchestration.inference_weights`.

Batching rule (Sample Factory's): take whoever is queued, in arrival order, up to ``max_batch_rows`` rows
(a request that does not fit opens the next batch). Wait -- at most ``max_wait_s`` -- only while the batch
holds fewer than three quarters of the rows of the largest of the last few batches ("nearly empty"): callers
just answered usually come straight back, while a lone caller is never kept waiting for company, and when
callers leave the threshold follows within a few batches. Never a barrier over all callers.

Hand-off order: the service thread hands back a batch's answers only once it has formed (concatenated) the
next batch from whoever is queued, without waiting for company, just before its forward: the woken callers'
Python then runs while that forward's matrix products release the GIL, instead of stalling the concatenation
(each torch call gives the GIL away, and the serving thread queues behind every woken caller to get it back).
With nothing queued, it hands them back at once and the batching rule applies.

Callers help (leader/follower): :meth:`InferenceService.act`, and any caller that calls
:meth:`InferenceService.serve_queued` before it waits, serves one batch of whatever is queued in its own thread
when no batch is being served at that moment and the queue is not nearly empty (a request that does not fit
goes back to the queue; :meth:`InferenceService.serve_alone` does not even queue a lone one): a lone caller pays
no hand-off to the service thread, while many wait for its batch instead of being served in small ones by
whoever comes first. One batch is served at a time, whoever serves it, so weights swap only between batches.

Deadlines: a request whose deadline passed before it was batched is dropped (its future raises
:class:`RequestExpired`, a ``TimeoutError``) and never holds up a batch; a caller that cancels its future
or simply goes away costs nothing. A request that makes its batch fail is retried alone, so only it fails.

Randomness: one ``torch.Generator`` owned by the service (``InferenceConfig.seed``). Sampled actions depend
on how requests fell into batches, so they are not reproducible per caller; ``deterministic=True``
requests (the mode: masked argmax, Gaussian mean) are.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor

from core.policies import GroupPolicy
from orchestration.inference_requests import (InferenceConfig, InferenceResult, Request, RequestExpired, ServiceClosed,
                                              answer_group, make_request, refuse_all, try_prepare)
from orchestration.inference_waits import get_within, hand_back
from orchestration.inference_weights import StagedWeights
from orchestration.devices import resolve_device

#: Batches whose size sets the "nearly empty" threshold (three quarters of the largest of them).
_RECENT_BATCHES = 8
_STOP = object()  # queued by close(): the service thread ends after the batch it is forming


class InferenceService:
    """Serves actions of ``policies`` in batches (module docstring: usage loop, shapes, batching rule).

    Args:
        policies: policy id -> module; the service acts with its own copies, on its device.
        config: batching and placement.
        versions: policy id -> version of the given weights (default 0).
        clock: monotonic seconds; deadlines and the batching wait read it (time is an argument).
    """

    def __init__(self, policies: Mapping[str, GroupPolicy], config: InferenceConfig | None = None, *,
                 versions: Mapping[str, int] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config = config or InferenceConfig()
        self.device = resolve_device(config.device)
        self._weights = StagedWeights(policies, versions or {}, self.device)
        self._policies, self._versions = self._weights.policies, self._weights.versions  # updated in place
        self._generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._clock = clock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # C-implemented: a put costs the caller ~0.2 µs
        self._carry: Request | None = None  # taken but did not fit: opens the next batch
        self._lock = threading.Lock()  # orders submit against close
        self._serving = threading.Lock()  # one batch at a time: the service thread's or a waiting caller's
        self._recent: deque[int] = deque(maxlen=_RECENT_BATCHES)
        self._enough = 1  # rows a batch needs to be served without waiting (the batching rule)
        self._queued_rows = 0  # rows of the requests in the queue (approximate: read without the lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._counts = dict(batches=0, rows=0, max_rows=0, served=0, dropped=0, cancelled=0, failed=0,
                            forwards=0, weight_swaps=0)

    # -- callers -----------------------------------------------------------------------------------------
    def submit(self, policy_id: str, obs: Mapping, *, shared: Any = None, timeout_s: float = 10.0,
               deterministic: bool = False, recurrent_state: Tensor | None = None,
               episode_start: Tensor | None = None) -> Future:
        """Queues a request; the future resolves to an :class:`InferenceResult`.

        Args:
            policy_id: which policy acts.
            obs: ``{"observation": [n, A, *obs] (leaf or tree), "action_mask"?: [n, A, k], "mask"?: [n, A]}``
                (a dict or a TensorDict).
            shared: ``[n, *]`` shared observation (leaf or tree), optional.
            timeout_s: the request's deadline, from now; one not batched by then is dropped.
            deterministic: act with the mode instead of sampling.
            recurrent_state: ``[n, A, H]`` (recurrent policies; None: zeros).
            episode_start: ``[n]`` or ``[n, A]`` bool, rows whose recurrent state is zeroed first.

        Raises:
            KeyError: unknown policy id. ValueError / TypeError: a malformed request (the message names the
            policy id and the entry). ServiceClosed: the service is closed.
        """
        return self._enqueue(self._request(policy_id, obs, shared=shared, timeout_s=timeout_s,
                                           deterministic=deterministic, recurrent_state=recurrent_state,
                                           episode_start=episode_start, answer=False))

    def _enqueue(self, request: Request):
        with self._lock:
            if self._closed:
                raise ServiceClosed("the inference service is closed")
            self._queue.put(request)
            self._queued_rows += request.rows
        return request.future

    def act(self, policy_id: str, obs: Mapping, **kwargs: Any) -> InferenceResult:
        """:meth:`submit`, :meth:`serve_queued`, and wait for the result (same arguments as :meth:`submit`);
        raises what the future raises."""
        if self._thread is None:
            raise RuntimeError("InferenceService.act before start(): nothing would serve the request")
        answer = self._enqueue(self._request(policy_id, obs, **kwargs, answer=True))
        self.serve_queued()
        return answer.result()

    def serve_alone(self, policy_id: str, obs: Mapping, *, shared: Any = None, deterministic: bool = False):
        """:meth:`act` for a lone caller, without the queue: served at once in this thread if the service is idle
        (nothing queued or being served) and ``obs`` is not "nearly empty"; its resolved answer, or None (then
        :meth:`submit` it). Runs under ``torch.inference_mode``: never change the results in place."""
        if self._queued_rows or self._carry is not None or self._closed or not self._serving.acquire(blocking=False):
            return None
        try:
            request = self._request(policy_id, obs, shared=shared, deterministic=deterministic, answer=True)
            if request.rows < self._enough or self._queued_rows or not self._queue.empty():
                return None  # others are queued, or callers come in company: batching serves them better
            with torch.inference_mode():
                hand_back(self._serve_locked([request], []))
            return request.future
        finally:
            self._serving.release()

    def serve_queued(self) -> bool:
        """Serves, in the calling thread, one batch of whatever is queued, if no batch is being served now
        and the queue is not nearly empty (a caller about to wait helps instead: a lone caller pays no thread
        hand-off; a nearly empty queue is left to the service thread, which waits a moment for more).
        Returns whether it served a batch."""
        if self._queued_rows < self._enough or not self._serving.acquire(blocking=False):
            return False  # too few rows queued to serve now: the service thread waits a moment for more
        try:
            batch, limit, rows = [], self.config.max_batch_rows, 0
            while rows < limit:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:  # closing: leave it (and what follows) to the service thread
                    self._queue.put(_STOP)
                    break
                if rows + item.rows > limit:
                    self._queue.put(item)  # goes to the back: still served, after this batch
                    break
                self._taken(item)
                if self._admit(item):
                    batch.append(item)
                    rows += item.rows
            if batch:
                with torch.no_grad():
                    hand_back(self._serve_locked(batch, []))
            return bool(batch)
        finally:
            self._serving.release()

    # -- learner side ------------------------------------------------------------------------------------
    def set_weights(self, policy_id: str, version: int, weights: TensorDictBase, force: bool = False) -> None:
        """Stages ``weights`` (``TensorDict.from_module`` layout) as ``version`` of ``policy_id``; the service
        loads them before its next batch, so no batch mixes versions. A later call before that wins. An older or
        the same version than the service has is ignored unless ``force`` (:meth:`StagedWeights.stage`)."""
        self._weights.stage(policy_id, version, weights, force)

    def weights(self, policy_id: str) -> TensorDictBase:
        """A copy of the weights the service acts with for ``policy_id`` (CPU)."""
        return self._weights.current(policy_id)

    def latest(self, policy_id: str, weights: bool = True) -> tuple[int, TensorDictBase | None]:
        """``(version, weights)`` of ``policy_id``: the newest staged by :meth:`set_weights` (what the next batch
        acts with), else the current ones; ``weights=False``: None for them, no copy (a check of a version). For
        callers that act elsewhere with a copy (local policies)."""
        return self._weights.latest(policy_id, weights)

    @property
    def versions(self) -> dict[str, int]:
        """Policy id -> version the service acts with now."""
        return dict(self._versions)

    def stats(self) -> dict[str, float]:
        """Counters: ``batches`` formed, ``mean_rows``/``max_rows`` per batch, ``mean_requests`` per batch,
        ``served``, ``dropped`` (expired), ``cancelled`` (by their callers), ``failed``, ``forwards`` (act_step
        calls) and ``weight_swaps``."""
        c = dict(self._counts)
        c["mean_rows"] = c["rows"] / c["batches"] if c["batches"] else 0.0
        c["mean_requests"] = c["served"] / c["batches"] if c["batches"] else 0.0
        return c

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> InferenceService:
        """Starts the service thread (requests submitted before wait in the queue)."""
        if self._thread is not None or self._closed:
            raise RuntimeError("InferenceService.start: already started or closed")
        self._thread = threading.Thread(target=self._run, name="shoal-inference", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuses new requests (:class:`ServiceClosed`), serves those queued before (as usual: expired ones
        are dropped), then stops the thread; requests to a service never started fail with ServiceClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)  # the thread serves everything before it, then ends
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # stuck in a forward: it still answers its queue when it returns
                return
        refuse_all([self._carry], self._queue)

    def __enter__(self) -> InferenceService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the service thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        answers: list = []  # the last batch's, handed back once the next one is formed (module docstring)
        with torch.no_grad():  # grad mode is per thread
            while True:
                batch, stop = [], False
                queued = self._queued_rows or self._carry is not None
                if answers and queued and self._serving.acquire(blocking=False):
                    try:  # whoever is queued, without waiting for company, unless a caller is serving a batch
                        batch, stop = self._gather(wait=False)
                        if batch:
                            answers = self._serve_locked(batch, answers)
                    finally:
                        self._serving.release()
                if not batch and not stop:
                    hand_back(answers)
                    batch, stop = self._gather()
                    if batch:
                        with self._serving:
                            answers = self._serve_locked(batch, answers)
                if stop:
                    hand_back(answers)
                    return

    def _serve_locked(self, batch: list[Request], previous: list) -> list:
        """One batch (the caller holds ``_serving``); hands back ``previous`` (the last batch's answers) once it is
        formed, and returns the answers of its last forward, for ``hand_back``."""
        answers: list = []
        try:
            self._serve_batch(batch, previous, answers)
        except Exception as error:  # noqa: BLE001 - a bug here must not leave callers waiting forever
            hand_back(previous)
            hand_back(answers)
            for r in batch:
                if not r.future.done():
                    self._counts["failed"] += 1
                    r.future.set_exception(error)
        return answers

    def _gather(self, wait: bool = True) -> tuple[list[Request], bool]:
        """Takes queued requests (the batching rule of the module docstring); ``(batch, stop after it)``.
        ``wait=False``: only what is queued now, never blocking."""
        limit, enough = self.config.max_batch_rows, self._enough
        batch: list[Request] = []
        rows, wait_until = 0, None
        while rows < limit:
            item = self._take(block=wait and not batch)
            if item is None:  # the queue is empty
                if rows >= enough or not wait:
                    break
                if wait_until is None:
                    wait_until = self._clock() + self.config.max_wait_s
                left = wait_until - self._clock()
                item = self._take(block=True, timeout=left) if left > 0 else None
                if item is None:
                    break
            if item is _STOP:
                return batch, True
            if rows + item.rows > limit:
                self._carry = item
                break
            if self._admit(item):
                batch.append(item)
                rows += item.rows
        return batch, False

    def _take(self, block: bool, timeout: float | None = None):
        if self._carry is not None:
            item, self._carry = self._carry, None
            return item
        try:  # never a timed SimpleQueue.get: callers' serve_queued also consume (get_within says why)
            item = self._queue.get(block) if timeout is None else get_within(self._queue, timeout)
        except queue.Empty:
            return None
        self._taken(item)
        return item

    def _taken(self, item) -> None:
        if item is not _STOP:
            with self._lock:
                self._queued_rows -= item.rows

    def _admit(self, r: Request) -> bool:
        """Whether ``r`` joins the batch: not cancelled by its caller, deadline not passed (else dropped)."""
        if not r.future.set_running_or_notify_cancel():
            with self._lock:  # the service thread and a helping caller may both admit
                self._counts["cancelled"] += 1
            return False
        late = self._clock() - r.deadline
        if late >= 0:
            with self._lock:
                self._counts["dropped"] += 1
            r.future.set_exception(RequestExpired(
                f"policy {r.policy_id!r}: request of {r.rows} rows expired {late * 1e3:.2f} ms before it was batched"))
            return False
        return True

    def _serve_batch(self, batch: list[Request], previous: list, answers: list) -> None:
        c = self._counts
        index = c["batches"]
        rows = sum(r.rows for r in batch)
        c["batches"] += 1
        c["rows"] += rows
        c["max_rows"] = max(c["max_rows"], rows)
        self._recent.append(rows)
        self._enough = min(self.config.max_batch_rows, (3 * max(self._recent) + 3) // 4)
        groups: dict[tuple[str, bool], list[Request]] = {}
        for r in batch:
            groups.setdefault((r.policy_id, r.deterministic), []).append(r)
        formed = [(pid, deterministic, requests, try_prepare(self._policies[pid], requests, self.device))
                  for (pid, deterministic), requests in groups.items()]
        hand_back(previous)  # woken now, their callers run while this batch's forward releases the GIL
        c["weight_swaps"] += self._weights.swap()  # between forwards: the whole batch acts with one version
        for pid, deterministic, requests, prepared in formed:
            hand_back(answers)  # an earlier group's: no answer waits for a forward after its own
            got, forwards = answer_group(self._policies[pid], requests, prepared, self._generator, deterministic,
                                         self.device, self._versions[pid], index)
            failed = sum(isinstance(value, BaseException) for _, value in got)
            c["forwards"] += forwards
            c["failed"] += failed
            c["served"] += len(got) - failed
            answers.extend(got)

    # -- request validation (in the caller's thread: a malformed request never reaches a batch) -----------
    def _request(self, pid, obs, *, shared=None, timeout_s=10.0, deterministic=False, recurrent_state=None,
                 episode_start=None, answer: bool) -> Request:
        self._weights.template(pid)  # a known policy id
        return make_request(pid, self._policies[pid], obs, shared, recurrent_state, episode_start,
                            max_rows=self.config.max_batch_rows, now=self._clock(), timeout_s=timeout_s,
                            deterministic=deterministic, answer=answer)


__all__ = ["InferenceConfig", "InferenceResult", "InferenceService", "RequestExpired", "ServiceClosed"]
