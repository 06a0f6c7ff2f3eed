"""Requests and results of the batched inference service (:mod:`orchestration.inference`), and its config:
requests are checked in the caller's thread, concatenated into one batch per policy, outputs split back per
caller.

Shapes (``n`` rows of one request, ``A`` agents of the policy's group, ``N`` rows of a batch)::

    request  observation        [n, A, *obs]     leaf, or tree of leaves each [n, A, ...]
             "action_mask"      [n, A, k] bool   optional (illegal actions are never chosen)
             "mask"             [n, A] bool      optional (agent present)
             shared             [n, *]           optional, leaf or tree (passed on; no critic runs here)
             recurrent_state    [n, A, H]        optional, recurrent policies only (None: zeros)
             episode_start      [n] or [n, A]    optional bool: rows whose state is zeroed first
    batch    every entry concatenated along dim 0: [N, A, ...]; a key some requests lack is filled with
             all-True (masks), zeros (state) or False (episode_start); shared only if every request has it
    result   InferenceResult: action [n, A, *act] (leaf or tree), log_prob [n, A, 1], version, ...
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import Tensor

from core.layout import ACTION, ACTION_MASK, LOG_PROB, MASK, NEXT, OBSERVATION, RECURRENT_STATE
from core.policies import GroupPolicy
from orchestration.config_kinds import check_fields
from orchestration.inference_waits import Answer

_KEYS = frozenset({OBSERVATION, ACTION_MASK, MASK})


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
        check_fields(self)
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
class Request:
    """One caller's request, checked (:func:`make_request`); the service resolves ``future``."""

    policy_id: str
    inputs: dict
    shared: Any
    state: Tensor | None
    start: Tensor | None
    rows: int
    deadline: float
    deterministic: bool
    future: Future | Answer


def make_request(pid: str, policy: GroupPolicy, obs: Mapping, shared: Any, state: Tensor | None,
                 start: Tensor | None, *, max_rows: int, now: float, timeout_s: Any, deterministic: bool,
                 answer: bool = False) -> Request:
    """A :class:`Request` once its entries have the shapes of the module docstring (a few µs: it runs for
    every request, in the caller's thread, so that a malformed one never reaches a batch).

    Raises:
        ValueError / TypeError: naming the policy id and the entry at fault.
    """
    if type(obs) is dict and shared is None and state is None and start is None \
            and type(timeout_s) in (float, int) and timeout_s >= 0:
        n = _plain_rows(obs, policy.num_agents, max_rows)  # the common request, checked in a few comparisons
        if n is not None:
            return Request(pid, dict(obs), None, None, None, n, now + timeout_s, bool(deterministic),
                           Answer() if answer else Future())
    if not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
        raise ValueError(f"policy {pid!r}: timeout_s must be a number >= 0 (every request has a deadline), "
                         f"got {timeout_s!r}")
    inputs = dict(obs) if type(obs) is dict else _as_tree(obs)  # ours: the caller may reuse its dict
    if not isinstance(inputs, dict) or OBSERVATION not in inputs:
        raise ValueError(f"policy {pid!r}: a request is a dict with an {OBSERVATION!r} entry")
    if not inputs.keys() <= _KEYS:
        raise ValueError(f"policy {pid!r}: unknown request entries {sorted(inputs.keys() - _KEYS)}")
    a, x = policy.num_agents, inputs[OBSERVATION]
    if isinstance(x, Tensor):
        leaves = [(OBSERVATION, x)]
    else:
        inputs[OBSERVATION] = x = _as_tree(x)
        leaves = list(_leaves(x, OBSERVATION))
    first = leaves[0][1] if leaves else None
    if first is not None and not isinstance(first, Tensor):
        _expect(pid, leaves[0][0], first, (), None)  # a TypeError naming the entry
    if first is None or first.dim() < 2:
        raise ValueError(f"policy {pid!r}: {OBSERVATION!r} must be [n, {a}, ...]")
    n = first.shape[0]
    if not 1 <= n <= max_rows:
        raise ValueError(f"policy {pid!r}: a request of {n} rows; this service takes 1 to max_batch_rows={max_rows}")
    for path, leaf in leaves:
        _expect(pid, path, leaf, (n, a), None)
    if (mask := inputs.get(MASK)) is not None:
        _expect(pid, MASK, mask, (n, a), 2)
    if (legal := inputs.get(ACTION_MASK)) is not None:
        _expect(pid, ACTION_MASK, legal, (n, a), 3)
    if shared is not None:
        shared = _as_tree(shared)
        for path, leaf in _leaves(shared, "shared"):
            _expect(pid, path, leaf, (n,), None)
    if state is not None or start is not None:
        if not policy.recurrent:
            raise ValueError(f"policy {pid!r} is not recurrent: it takes no recurrent_state/episode_start")
        if state is not None:
            _expect(pid, "recurrent_state", state, (n, a, policy.state_size), 3)
        if start is not None:
            if start.dtype != torch.bool or tuple(start.shape) not in ((n,), (n, a)):
                raise ValueError(f"policy {pid!r}: episode_start must be bool [{n}] or [{n}, {a}], "
                                 f"got {start.dtype} {tuple(start.shape)}")
            start = start.reshape(n, 1).expand(n, a) if start.dim() == 1 else start  # one layout to concatenate
    waiter = Answer() if answer else Future()
    return Request(pid, inputs, shared, state, start, n, now + timeout_s, bool(deterministic), waiter)


def _plain_rows(obs: dict, agents: int, max_rows: int) -> int | None:
    """Rows ``n`` of a request that is plain tensors of the right shapes (``observation`` ``[n, A, ...]``, with
    1 <= n <= ``max_rows``; optional ``action_mask`` ``[n, A, k]`` and ``mask`` ``[n, A]``, nothing else); None
    for anything else, which :func:`make_request` then accepts or refuses with its named error."""
    x = obs.get(OBSERVATION)
    if type(x) is not Tensor:
        return None
    shape = x.shape
    if len(shape) < 2 or shape[1] != agents or not 1 <= (n := shape[0]) <= max_rows:
        return None
    if len(obs) > 1:
        legal, mask = obs.get(ACTION_MASK), obs.get(MASK)
        if len(obs) != 1 + (legal is not None) + (mask is not None):
            return None  # an unknown entry
        if legal is not None and (type(legal) is not Tensor or legal.dim() != 3 or legal.shape[0] != n
                                  or legal.shape[1] != agents):
            return None
        if mask is not None and (type(mask) is not Tensor or mask.shape != (n, agents)):
            return None
    return n


def refuse_all(items: list, waiting: queue.SimpleQueue) -> None:
    """Fails the requests among ``items`` and those left in ``waiting`` (emptied) with :class:`ServiceClosed`."""
    while True:
        try:
            items.append(waiting.get_nowait())
        except queue.Empty:
            break
    for r in items:
        if isinstance(r, Request) and r.future.set_running_or_notify_cancel():
            r.future.set_exception(ServiceClosed(f"policy {r.policy_id!r}: the service closed first"))


def _expect(pid: str, path: str, t: Any, lead: tuple[int, ...], ndim: int | None) -> None:
    """Raises unless ``t`` is a tensor whose shape starts with ``lead`` (and has ``ndim`` dims, if given)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"policy {pid!r}: {path} is a {type(t).__name__}, expected a tensor")
    shape = t.shape
    if shape[: len(lead)] != lead or (ndim is not None and len(shape) != ndim):
        raise ValueError(f"policy {pid!r}: {path} has shape {tuple(shape)}, expected "
                         f"[{', '.join(map(str, lead))}{', ...' if ndim is None else ''}]")


def check_weights(policy_id: str, template: TensorDictBase, weights: TensorDictBase) -> None:
    """Raises ValueError naming the policy and entry unless ``weights`` has exactly ``template``'s entries and
    shapes (``TensorDict.from_module`` layout)."""
    extra = set(weights.keys(True, True)) - set(template.keys(True, True))
    if extra:
        raise ValueError(f"policy {policy_id!r}: weights entries {sorted(map(str, extra))} are not in the policy")
    for key, value in template.items(True, True):
        got = weights.get(key, None)
        if got is None or got.shape != value.shape:
            name = ".".join(key) if isinstance(key, tuple) else key
            raise ValueError(f"policy {policy_id!r}: weights entry {name!r} is "
                             f"{None if got is None else tuple(got.shape)}, expected {tuple(value.shape)}")


def concatenate(requests: list[Request], policy: GroupPolicy) -> tuple[dict, Any, Tensor | None, Tensor | None]:
    """``(inputs, shared, state, start)`` of a batch: every entry concatenated along dim 0. An entry some
    requests lack is filled in: masks with True (an absent mask allows everything), the recurrent state
    with zeros, ``episode_start`` with False; ``shared`` is kept only if every request has it."""
    inputs = {OBSERVATION: _cat([r.inputs[OBSERVATION] for r in requests])}
    for key in (MASK, ACTION_MASK):
        parts = [r.inputs.get(key) for r in requests]
        like = next((p for p in parts if p is not None), None)
        if like is not None:
            inputs[key] = torch.cat([p if p is not None else torch.ones(r.rows, *like.shape[1:], dtype=torch.bool)
                                     for p, r in zip(parts, requests)])
    shared = _cat([r.shared for r in requests]) if all(r.shared is not None for r in requests) else None
    state = start = None
    a, h = policy.num_agents, policy.state_size
    if any(r.state is not None for r in requests):
        state = torch.cat([r.state if r.state is not None else torch.zeros(r.rows, a, h) for r in requests])
    if any(r.start is not None for r in requests):
        start = torch.cat([r.start if r.start is not None else torch.zeros(r.rows, a, dtype=torch.bool)
                           for r in requests])
    return inputs, shared, state, start


def split(tree, sizes: list[int]) -> list:
    """``tree`` (leaves ``[N, ...]``) cut into views of ``sizes`` rows: one ``split`` per leaf, not per caller."""
    if isinstance(tree, Tensor):
        return list(tree.split(sizes))
    parts = {k: split(v, sizes) for k, v in tree.items()}
    return [{k: v[i] for k, v in parts.items()} for i in range(len(sizes))]


def to_device(tree, device: torch.device):
    """``tree`` (or None) on ``device``; asynchronous only towards an accelerator (a copy to the CPU must be
    complete before a caller reads it)."""
    if tree is None or isinstance(tree, Tensor):
        return tree if tree is None else tree.to(device, non_blocking=device.type != "cpu")
    return {k: to_device(v, device) for k, v in tree.items()}


def _as_tree(x):
    """A TensorDict or mapping as nested plain dicts (the policy reads those fastest); tensors as they are."""
    if isinstance(x, (TensorDictBase, Mapping)):
        return {k: _as_tree(v) for k, v in x.items()}
    return x


def _leaves(tree, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}/{k}")
    else:
        yield path, tree


def _cat(parts: list):
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return {k: _cat([p[k] for p in parts]) for k in parts[0]}


def prepare(policy: GroupPolicy, requests: list[Request], device: torch.device) -> tuple:
    """``(inputs, shared, state, start)`` of ``requests`` as ONE batch on ``device`` (:func:`concatenate`; a lone
    request's own tensors). Separate from :func:`forward` so that a server can form the next batch before it
    wakes the callers of the last one (:mod:`orchestration.inference` says why)."""
    if len(requests) == 1:  # a lone caller: nothing to concatenate or split
        r = requests[0]
        prepared = r.inputs, r.shared, r.state, r.start
    else:
        prepared = concatenate(requests, policy)
    if device.type != "cpu":
        prepared = tuple(to_device(x, device) for x in prepared)
    return prepared


def try_prepare(policy: GroupPolicy, requests: list[Request], device: torch.device) -> tuple | None:
    """:func:`prepare`, or None where ``requests`` do not concatenate (:func:`answer_group` then finds the culprit)."""
    try:
        return prepare(policy, requests, device)
    except Exception:  # noqa: BLE001 - one of them is malformed: answered one by one
        return None


def answer_group(policy: GroupPolicy, requests: list[Request], prepared: tuple | None, generator: torch.Generator,
                 deterministic: bool, device: torch.device, version: int, index: int) -> tuple[list, int]:
    """ONE :func:`forward` for ``requests`` (``prepared``: their batch by :func:`try_prepare`, None where they did
    not concatenate): ``(answers, forwards run)``, answers ``(future, InferenceResult)`` in request order. On an
    error each request is retried alone, so that only the culprit's answer is ``(future, error)``."""
    forwards = 0
    if prepared is not None or len(requests) == 1:  # else they do not concatenate: answered one by one below
        try:
            forwards = 1
            results = forward(policy, requests, prepared if prepared is not None else prepare(policy, requests, device),
                              generator, deterministic, device, version, index)
            return list(zip([r.future for r in requests], results)), 1
        except Exception as error:  # noqa: BLE001 - the callers get it, the service keeps serving
            if len(requests) == 1:
                return [(requests[0].future, error)], 1
    answers = []
    for r in requests:
        got, n = answer_group(policy, [r], None, generator, deterministic, device, version, index)
        answers, forwards = answers + got, forwards + n
    return answers, forwards


def forward(policy: GroupPolicy, requests: list[Request], prepared: tuple, generator: torch.Generator,
            deterministic: bool, device: torch.device, version: int, index: int) -> list[InferenceResult]:
    """ONE ``act_step`` of ``policy`` (on ``device``) for ``requests`` (``prepared`` by :func:`prepare`); each
    caller's share back on the CPU, labelled with the weights ``version`` and the batch ``index``."""
    inputs, shared, state, start = prepared
    out = policy.act_step(inputs, shared, generator, deterministic, state, start, with_value=False, with_log_prob=True)
    if device.type != "cpu":
        out = to_device(out, torch.device("cpu"))  # blocking: the callers read it at once
    if len(requests) == 1 and not policy.recurrent:  # the whole output is the lone caller's
        return [InferenceResult(out[ACTION], out[LOG_PROB], version, index)]
    sizes = [r.rows for r in requests]
    actions, log_probs = split(out[ACTION], sizes), split(out[LOG_PROB], sizes)
    if not policy.recurrent:
        return [InferenceResult(a, lp, version, index) for a, lp in zip(actions, log_probs)]
    used, nxt = split(out[RECURRENT_STATE], sizes), split(out[NEXT][RECURRENT_STATE], sizes)
    return [InferenceResult(a, lp, version, index, u, s) for a, lp, u, s in zip(actions, log_probs, used, nxt)]


__all__ = ["InferenceConfig", "InferenceResult", "Request", "RequestExpired", "ServiceClosed",
           "answer_group", "check_weights", "concatenate", "forward", "make_request", "prepare", "refuse_all", "split",
           "to_device", "try_prepare"]
