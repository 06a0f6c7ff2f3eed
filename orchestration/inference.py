"""Batched inference service (seed 003): many callers ask one service for actions; it answers in batches.

A thread owned by the service forms a batch from the requests waiting, concatenates them along the batch
dim, runs ONE :meth:`core.policies.GroupPolicy.act_step` per policy on the service's device (CUDA when
present), splits the outputs back and resolves each caller's :class:`concurrent.futures.Future`. Plain
Python + torch + threads: no Ray here (a Ray actor may host it later, as the seeds' rollout workers would).

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
    service.close()                      # requests still queued fail with ServiceClosed

Shapes (``n`` rows of one request, ``A`` agents of the policy's group, ``N`` rows of a batch)::

    request  observation        [n, A, *obs]     leaf, or tree of leaves each [n, A, ...]
             "action_mask"      [n, A, k] bool   optional (illegal actions are never chosen)
             "mask"             [n, A] bool      optional (agent present)
             shared             [n, *]           optional, leaf or tree (read by policies that need it)
             recurrent_state    [n, A, H]        optional, recurrent policies only (None: zeros)
             episode_start      [n] or [n, A]    optional bool: rows whose state is zeroed first
    batch    every entry concatenated along dim 0: [N, A, ...]; a key some requests lack is filled with
             all-True (masks), zeros (state) or False (episode_start); shared only if every request has it
    result   InferenceResult: action [n, A, *act] (leaf or tree), log_prob [n, A, 1], version, ...

Batching rule (Sample Factory's): take whoever is queued, in arrival order, up to ``max_batch_rows`` rows
(a request that does not fit opens the next batch). Wait -- at most ``max_wait_s`` -- only while the batch
holds fewer than half the rows of the largest of the last few batches: callers just answered usually come
straight back, while a lone caller is never kept waiting for company. Never a barrier over all callers.

Deadlines: a request whose deadline passed before it was batched is dropped (its future raises
:class:`RequestExpired`, a ``TimeoutError``) and never holds up a batch; a caller that cancels its future
or simply goes away costs nothing. A request that makes its batch fail is retried alone, so only it fails.

Randomness: one ``torch.Generator`` owned by the service (``InferenceConfig.seed``). Sampled actions depend
on how requests fell into batches, so they are not reproducible per caller; ``deterministic=True``
requests (the mode: masked argmax, Gaussian mean) are.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from core.layout import ACTION, ACTION_MASK, LOG_PROB, MASK, NEXT, OBSERVATION, RECURRENT_STATE
from core.policies import GroupPolicy
from orchestration.learner import resolve_device

#: Batches whose size sets the "nearly empty" threshold (the largest of them, halved).
_RECENT_BATCHES = 8
_STOP = object()  # queued by close(): the service thread ends after the batch it is forming


@dataclass(frozen=True, kw_only=True, slots=True)
class InferenceConfig:
    """How an :class:`InferenceService` batches and where it runs."""

    max_batch_rows: int = 1024
    """Most request rows (the leading dim ``n`` of each request) one batch holds; a request with more is refused."""
    max_wait_s: float = 0.001
    """Longest a nearly empty batch waits for more requests once its first one was taken (Sample Factory's
    rule; the batch is served as soon as it is full enough, whatever is left of this)."""
    device: str = "auto"
    """Where the forward passes run: ``auto`` (CUDA when present, else CPU) or a torch device name."""
    seed: int = 0
    """Seed of the service's sampling generator, the only source of randomness of its actions."""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_batch_rows, int) and self.max_batch_rows >= 1):
            raise ValueError(f"InferenceConfig.max_batch_rows must be an int >= 1, got {self.max_batch_rows!r}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"InferenceConfig.max_wait_s must be >= 0, got {self.max_wait_s!r}")


@dataclass(frozen=True, slots=True)
class InferenceResult:
    """One caller's share of a batch (CPU tensors)."""

    action: Any
    """``[n, A, *act]``: a tensor, or a tree (nested dicts) of them for composite action specs."""
    log_prob: Tensor
    """``[n, A, 1]`` behaviour log-probability of ``action``."""
    version: int
    """Version of the weights that produced it."""
    batch: int
    """Index of the batch that served it (0, 1, ...), for diagnostics."""
    recurrent_state: Tensor | None = None
    """Recurrent policies: the state ``[n, A, H]`` this step used (zeroed where ``episode_start``): store it."""
    next_recurrent_state: Tensor | None = None
    """Recurrent policies: the state ``[n, A, H]`` to send with the next request."""


class RequestExpired(TimeoutError):
    """A request's deadline passed before the service could batch it."""


class ServiceClosed(RuntimeError):
    """The service was closed before it served the request."""


@dataclass(slots=True, eq=False)
class _Request:
    policy_id: str
    inputs: dict  # observation, optional action_mask / mask
    shared: Any
    state: Tensor | None
    start: Tensor | None
    rows: int
    deadline: float
    deterministic: bool
    future: Future


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
        self._policies = {pid: copy.deepcopy(p).to(self.device).eval() for pid, p in policies.items()}
        self._templates = {pid: TensorDict.from_module(p) for pid, p in self._policies.items()}
        self._versions = {pid: int((versions or {}).get(pid, 0)) for pid in self._policies}
        self._generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._clock = clock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # C-implemented: a put costs the caller ~0.2 µs
        self._carry: _Request | None = None  # taken but did not fit: opens the next batch
        self._lock = threading.Lock()  # orders submit against close, and guards _pending
        self._pending: dict[str, tuple[int, TensorDictBase]] = {}
        self._recent: deque[int] = deque(maxlen=_RECENT_BATCHES)
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
        request = self._request(policy_id, obs, shared, timeout_s, deterministic, recurrent_state, episode_start)
        with self._lock:
            if self._closed:
                raise ServiceClosed("the inference service is closed")
            self._queue.put(request)
        return request.future

    def act(self, policy_id: str, obs: Mapping, **kwargs: Any) -> InferenceResult:
        """:meth:`submit` and wait for the result (same arguments); raises what the future raises."""
        if self._thread is None:
            raise RuntimeError("InferenceService.act before start(): nothing would serve the request")
        return self.submit(policy_id, obs, **kwargs).result()

    # -- learner side ------------------------------------------------------------------------------------
    def set_weights(self, policy_id: str, version: int, weights: TensorDictBase) -> None:
        """Stages ``weights`` (``TensorDict.from_module`` layout) as ``version`` of ``policy_id``; the service
        loads them before its next batch, so no batch mixes versions. A later call before that wins."""
        template = self._template(policy_id)
        for key, value in template.items(True, True):
            got = weights.get(key, None)
            if got is None or got.shape != value.shape:
                name = ".".join(key) if isinstance(key, tuple) else key
                raise ValueError(f"policy {policy_id!r}: weights entry {name!r} is "
                                 f"{None if got is None else tuple(got.shape)}, expected {tuple(value.shape)}")
        staged = weights.detach().to(self.device).clone()  # ours: the caller may reuse its tensors at once
        with self._lock:
            self._pending[policy_id] = (int(version), staged)

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
        """Serves the batch being formed, then stops; requests still queued fail with :class:`ServiceClosed`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout_s)
        leftovers = [self._carry] if self._carry is not None else []
        while True:
            try:
                leftovers.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for r in leftovers:
            if isinstance(r, _Request) and r.future.set_running_or_notify_cancel():
                r.future.set_exception(ServiceClosed(f"policy {r.policy_id!r}: the service closed first"))

    def __enter__(self) -> InferenceService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the service thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        with torch.no_grad():  # grad mode is per thread
            while True:
                batch, stop = self._gather()
                try:
                    if batch:
                        self._swap_weights()  # between batches: this one sees one version per policy
                        self._serve_batch(batch)
                except Exception as error:  # noqa: BLE001 - a bug here must not leave callers waiting forever
                    for r in batch:
                        if not r.future.done():
                            self._counts["failed"] += 1
                            r.future.set_exception(error)
                if stop:
                    return

    def _gather(self) -> tuple[list[_Request], bool]:
        """Takes queued requests (the batching rule of the module docstring); ``(batch, stop after it)``."""
        limit = self.config.max_batch_rows
        enough = min(limit, (max(self._recent) + 1) // 2) if self._recent else 1
        batch: list[_Request] = []
        rows, wait_until = 0, None
        while rows < limit:
            item = self._take(block=not batch)
            if item is None:  # the queue is empty
                if rows >= enough:
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
        try:
            return self._queue.get(block, timeout)
        except queue.Empty:
            return None

    def _admit(self, r: _Request) -> bool:
        """Whether ``r`` joins the batch: not cancelled by its caller, deadline not passed (else dropped)."""
        if not r.future.set_running_or_notify_cancel():
            self._counts["cancelled"] += 1
            return False
        late = self._clock() - r.deadline
        if late >= 0:
            self._counts["dropped"] += 1
            r.future.set_exception(RequestExpired(
                f"policy {r.policy_id!r}: request of {r.rows} rows expired {late * 1e3:.2f} ms before it was batched"))
            return False
        return True

    def _swap_weights(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for pid, (version, weights) in pending.items():
            self._templates[pid].update_(weights)  # copies into the module's own parameters
            self._versions[pid] = version
            self._counts["weight_swaps"] += 1

    def _serve_batch(self, batch: list[_Request]) -> None:
        c = self._counts
        index = c["batches"]
        rows = sum(r.rows for r in batch)
        c["batches"] += 1
        c["rows"] += rows
        c["max_rows"] = max(c["max_rows"], rows)
        self._recent.append(rows)
        groups: dict[tuple[str, bool], list[_Request]] = {}
        for r in batch:
            groups.setdefault((r.policy_id, r.deterministic), []).append(r)
        for (pid, deterministic), requests in groups.items():
            self._serve(pid, deterministic, requests, index)

    def _serve(self, pid: str, deterministic: bool, requests: list[_Request], index: int) -> None:
        """One forward for ``requests``; on an error each is retried alone so that only the culprit fails."""
        try:
            results = self._forward(pid, deterministic, requests, index)
        except Exception as error:  # noqa: BLE001 - the callers get it, the service keeps serving
            if len(requests) > 1:
                for r in requests:
                    self._serve(pid, deterministic, [r], index)
                return
            self._counts["failed"] += 1
            requests[0].future.set_exception(error)
            return
        self._counts["served"] += len(requests)
        for r, result in zip(requests, results):
            r.future.set_result(result)

    def _forward(self, pid: str, deterministic: bool, requests: list[_Request], index: int) -> list[InferenceResult]:
        policy = self._policies[pid]
        if len(requests) == 1:  # a lone caller: nothing to concatenate or split
            r = requests[0]
            inputs, shared, state, start = r.inputs, r.shared, r.state, r.start
        else:
            inputs, shared, state, start = _concatenate(requests, policy)
        if self.device.type != "cpu":
            inputs, shared, state, start = (_to(x, self.device) for x in (inputs, shared, state, start))
        self._counts["forwards"] += 1
        out = policy.act_step(inputs, shared, self._generator, deterministic, state, start,
                              with_value=False, with_log_prob=True)
        if self.device.type != "cpu":
            out = _to(out, torch.device("cpu"))  # blocking: the callers read it at once
        version, sizes = self._versions[pid], [r.rows for r in requests]
        actions, log_probs = _split(out[ACTION], sizes), _split(out[LOG_PROB], sizes)
        if policy.gru is None:
            return [InferenceResult(a, lp, version, index) for a, lp in zip(actions, log_probs)]
        used, nxt = _split(out[RECURRENT_STATE], sizes), _split(out[NEXT][RECURRENT_STATE], sizes)
        return [InferenceResult(a, lp, version, index, u, s) for a, lp, u, s in zip(actions, log_probs, used, nxt)]

    # -- request validation (in the caller's thread: a malformed request never reaches a batch) -----------
    def _template(self, policy_id: str) -> TensorDictBase:
        if policy_id not in self._policies:
            raise KeyError(f"unknown policy id {policy_id!r}: this service serves {sorted(self._policies)}")
        return self._templates[policy_id]

    def _request(self, pid, obs, shared, timeout_s, deterministic, state, start) -> _Request:
        self._template(pid)
        policy = self._policies[pid]
        a = policy.num_agents
        inputs = _as_tree(obs)
        if not isinstance(inputs, dict) or OBSERVATION not in inputs:
            raise ValueError(f"policy {pid!r}: a request is a dict with an {OBSERVATION!r} entry")
        unknown = set(inputs) - {OBSERVATION, ACTION_MASK, MASK}
        if unknown:
            raise ValueError(f"policy {pid!r}: unknown request entries {sorted(unknown)}")
        leaves = list(_leaves(inputs[OBSERVATION], OBSERVATION))
        if not leaves or leaves[0][1].dim() < 2:
            raise ValueError(f"policy {pid!r}: {OBSERVATION!r} must be [n, {a}, ...]")
        n = leaves[0][1].shape[0]
        if not 1 <= n <= self.config.max_batch_rows:
            raise ValueError(f"policy {pid!r}: a request of {n} rows; this service takes 1 to "
                             f"max_batch_rows={self.config.max_batch_rows}")
        # (entry, tensor, leading shape it must have, its exact number of dims or None)
        checks = [(path, leaf, (n, a), None) for path, leaf in leaves]
        if inputs.get(MASK) is not None:
            checks.append((MASK, inputs[MASK], (n, a), 2))
        if inputs.get(ACTION_MASK) is not None:
            checks.append((ACTION_MASK, inputs[ACTION_MASK], (n, a), 3))
        if shared is not None:
            shared = _as_tree(shared)
            checks += [(path, leaf, (n,), None) for path, leaf in _leaves(shared, "shared")]
        if state is not None or start is not None:
            if policy.gru is None:
                raise ValueError(f"policy {pid!r} is not recurrent: it takes no recurrent_state/episode_start")
            if state is not None:
                checks.append(("recurrent_state", state, (n, a, policy.config.recurrent_size), 3))
            if start is not None:
                if start.dtype != torch.bool or tuple(start.shape) not in ((n,), (n, a)):
                    raise ValueError(f"policy {pid!r}: episode_start must be bool [{n}] or [{n}, {a}], "
                                     f"got {start.dtype} {tuple(start.shape)}")
                start = start.reshape(n, 1).expand(n, a) if start.dim() == 1 else start  # one layout to concatenate
        for path, leaf, lead, ndim in checks:
            if tuple(leaf.shape[: len(lead)]) != lead or (ndim is not None and leaf.dim() != ndim):
                raise ValueError(f"policy {pid!r}: {path} has shape {tuple(leaf.shape)}, expected "
                                 f"[{', '.join(map(str, lead))}{', ...' if ndim is None else ''}] "
                                 f"({n} rows of {a} agents)")
        return _Request(pid, inputs, shared, state, start, n, self._clock() + timeout_s, bool(deterministic),
                        Future())


# -- trees of tensors (nested plain dicts) ---------------------------------------------------------------
def _as_tree(x):
    """A TensorDict or mapping as nested plain dicts (the policy reads those fastest); tensors as they are."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (TensorDictBase, Mapping)):
        return {k: _as_tree(v) for k, v in x.items()}
    return x


def _leaves(tree, path: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(tree, Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}/{k}")
    else:
        raise TypeError(f"{path} is a {type(tree).__name__}, expected a tensor or a dict of tensors")


def _cat(parts: list):
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return {k: _cat([p[k] for p in parts]) for k in parts[0]}


def _split(tree, sizes: list[int]) -> list:
    """``tree`` (leaves ``[N, ...]``) cut into views of ``sizes`` rows: one ``split`` per leaf, not per caller."""
    if isinstance(tree, Tensor):
        return list(tree.split(sizes))
    parts = {k: _split(v, sizes) for k, v in tree.items()}
    return [{k: v[i] for k, v in parts.items()} for i in range(len(sizes))]


def _to(tree, device: torch.device):
    """``tree`` on ``device``; asynchronous only towards an accelerator (a copy to the CPU must be complete
    before a caller reads it)."""
    if tree is None or isinstance(tree, Tensor):
        return tree if tree is None else tree.to(device, non_blocking=device.type != "cpu")
    return {k: _to(v, device) for k, v in tree.items()}


def _concatenate(requests: list[_Request], policy: GroupPolicy):
    """The batch's inputs: every entry concatenated along dim 0, missing optional ones filled (module docstring)."""
    inputs = {OBSERVATION: _cat([r.inputs[OBSERVATION] for r in requests])}
    for key in (MASK, ACTION_MASK):
        parts = [r.inputs.get(key) for r in requests]
        like = next((p for p in parts if p is not None), None)
        if like is not None:  # an absent mask allows everything
            inputs[key] = torch.cat([p if p is not None else torch.ones(r.rows, *like.shape[1:], dtype=torch.bool)
                                     for p, r in zip(parts, requests)])
    shared = _cat([r.shared for r in requests]) if all(r.shared is not None for r in requests) else None
    state = start = None
    if any(r.state is not None for r in requests):
        h = policy.config.recurrent_size
        state = torch.cat([r.state if r.state is not None else torch.zeros(r.rows, policy.num_agents, h)
                           for r in requests])
    if any(r.start is not None for r in requests):
        start = torch.cat([r.start if r.start is not None else torch.zeros(r.rows, policy.num_agents, dtype=torch.bool)
                           for r in requests])
    return inputs, shared, state, start


__all__ = ["InferenceConfig", "InferenceResult", "InferenceService", "RequestExpired", "ServiceClosed"]
