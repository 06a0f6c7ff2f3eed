"""Slow or crash-prone batched envs in subprocesses, behind the same protocol, with restarts.

:class:`EnvWorkerPool` runs one factory-built :class:`~adapters.protocol.BatchedEnv` in each of K processes and
presents them as one batch (``num_envs`` = the sum, worker ``k``'s envs at ``offsets[k]:offsets[k] + n_k``).
Observations and actions travel through preallocated shared-memory tensors (``share_memory_()``, one per
leaf, laid out from the tree); a pipe per worker carries only commands and small replies.

Faults: a worker that dies, raises, or does not answer within ``step_timeout_s`` is killed and restarted
(same factory, a new seed). Its in-flight episodes end as truncated in the step that noticed: ``next`` holds
the last observation it returned (reward 0, ``truncated`` True for the agents present), the root holds the
first observation of the restarted env. ``counters`` counts ``env_restarts``, ``episodes_lost`` (one per env
of the worker), ``step_timeouts``, ``worker_crashes`` (process died) and ``worker_errors`` (the env raised),
plus the workers' own counters summed over every incarnation.

Seeding: ``reset(seed)`` resets worker ``k`` with ``seed + offsets[k]`` (its envs' indices in the pool);
a restarted worker gets a seed derived from ``(seed, k, incarnation)`` so it never replays an episode.

Two ways to step. :meth:`EnvWorkerPool.step` is lock-step: every worker steps and the call waits for all
of them, so the slowest worker sets the pace. The split-phase API lets workers advance independently (a
polling actor, :mod:`orchestration.polling_actor`, serves whichever finished)::

    pool.reset(seed=0)
    obs = [pool.root(k) for k in range(pool.num_workers)]      # worker k's first step to act on, batch [n_k]
    pool.send(actions, [0, 2])        # actions batch [n_0 + n_2]: worker 0's slice, then worker 2's
    for k in pool.poll(timeout_s=None):                        # the workers whose step finished
        out = pool.result(k)          # batch [n_k], the layout of step()'s output, its own copy
        pool.send(next_actions_for(out), [k])

Faults are handled per worker exactly as in :meth:`~EnvWorkerPool.step`; the step timeout of a worker runs
from its own :meth:`~EnvWorkerPool.send`.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import weakref
from multiprocessing.connection import wait
from typing import Callable, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from core.layout import ACTION, NEXT
from core.specs import Tree, from_json, groups, zeros
from core.tensordicts import clone_td

from .checking import EnvOutputError
from .env_process import EnvWorkerConfig, EnvWorkerFault, step_template, truncate_
from .env_process import WorkerProcess as _Worker
from .env_process import collect_replies as _collect, command as _command
from .env_process import kill_all as _kill_all
from .protocol import BatchedEnv


_OWN_COUNTERS = ("env_restarts", "episodes_lost", "step_timeouts", "worker_crashes", "worker_errors")


class EnvWorkerPool:
    """K subprocess workers, each running ``factories[k]()``, as one :class:`BatchedEnv` (module doc)."""

    def __init__(self, factories: Sequence[Callable[[], BatchedEnv]], config: EnvWorkerConfig | None = None) -> None:
        self.config = config if config is not None else EnvWorkerConfig()
        if not factories:
            raise ValueError("need at least one factory")
        self._ctx = mp.get_context(self.config.start_method)
        if self.config.start_method == "forkserver":
            self._ctx.set_forkserver_preload(["core", "torch", "tensordict", "core.specs"])  # core first: its dynamo deferral
        self._own = dict.fromkeys(_OWN_COUNTERS, 0)
        self._worker_counters: list[dict] = [{} for _ in factories]
        self._cut: list[list[int]] = [[] for _ in factories]  # per worker: its last step's cut envs (local indices)
        self.last_cut = np.zeros(0, dtype=np.int64)  # the envs whose episode the last step() cut (adapters.protocol)
        self._past_counters: dict[str, int] = {}
        self._seed, self._last, self._closed = None, None, False
        self._fault: tuple[str, object] = ("error", "")
        self._workers = [_Worker(i, f, self._ctx, self.config) for i, f in enumerate(factories)]
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        try:
            trees, sizes = zip(*[self._handshake(w) for w in self._workers])
            if len(set(trees)) != 1:
                raise ValueError("the workers' envs have different trees; a pool needs one tree")
        except BaseException:
            self.close()
            raise
        sizes = list(sizes)
        self._tree, self._tree_json, self._sizes = from_json(trees[0]), trees[0], sizes
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        total = sum(sizes)
        self._out = step_template(self._tree, total).share_memory_()
        self._act = zeros(self._tree, [total]).select(*[(g, ACTION) for g in groups(self._tree)]).share_memory_()
        self._act_leaves = list(self._act.items(True, True))
        # per-worker views of the shared output buffer: a finished worker's slice is cloned from its view
        self._views = [self._out[self._slice(k)] for k in range(len(sizes))]
        self._sent: dict[int, float] = {}  # split phase: worker in flight -> time of its send (its timeout clock)
        self._early: dict[int, tuple] = {}  # worker whose send already failed -> its fault, reported by poll
        self._results: dict[int, TensorDict] = {}  # finished worker -> its output [n_k], until result() takes it
        self._roots: dict[int, TensorDict] = {}  # worker -> its root obs [n_k] where newer than self._last
        for w in self._workers:
            self._send_buffers(w)

    @property
    def tree(self) -> Tree:
        return self._tree

    @property
    def num_envs(self) -> int:
        return sum(self._sizes)

    @property
    def counters(self) -> dict[str, int]:
        out = dict(self._own)
        for c in (self._past_counters, *self._worker_counters):
            for k, v in c.items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def num_workers(self) -> int:
        """``K``, the number of worker processes."""
        return len(self._sizes)

    @property
    def sizes(self) -> list[int]:
        """``n_k``, the number of envs of each worker (worker ``k``'s envs are ``offsets[k]:offsets[k] + n_k``)."""
        return list(self._sizes)

    @property
    def in_flight(self) -> list[int]:
        """Workers sent a step (:meth:`send`) that :meth:`poll` has not reported finished yet, sorted."""
        return sorted(self._sent)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring and fault-injection tests)."""
        return [w.proc.pid for w in self._workers]

    def reset(self, seed: int | None = None) -> TensorDict:
        """Resets every worker (worker ``k`` with ``seed + offsets[k]``) and returns the first step to act on."""
        while self._sent:  # split-phase steps still running: let them end first (their outputs are dropped)
            self.poll(timeout_s=None)
        self._results.clear()
        self._roots.clear()
        self._seed = seed if seed is not None else self._seed  # a reset that continues keeps restarts seeded
        seeds = lambda w: ("reset", None if seed is None else seed + self.offsets[w.index])  # noqa: E731
        for i, reply in _command(self._workers, seeds, self.config.step_timeout_s).items():
            if not self._accept(i, reply):
                if not self.config.restart:
                    self._raise(i)
                self._restart(i)
        self._last = self._out.exclude(NEXT).clone()
        return self._last.clone()

    def step(self, actions: TensorDict) -> TensorDict:
        """Steps every worker; a failed worker's envs end truncated and restart (module doc)."""
        if self._last is None:
            raise RuntimeError("call reset() before step()")
        if self._sent:
            raise RuntimeError(f"workers {self.in_flight} are in flight (send()); poll() them before step()")
        if self._roots:  # split-phase steps moved some workers on: their roots are the newest
            self._last = torch.cat([self._root(k) for k in range(self.num_workers)])
            self._roots.clear()
        self._results.clear()
        for key, buf in self._act_leaves:
            buf.copy_(actions.get(key))
        replies = _command(self._workers, lambda w: ("step", None), self.config.step_timeout_s)
        failed = [i for i, reply in sorted(replies.items()) if not self._accept(i, reply)]
        if failed and not self.config.restart:
            self._raise(failed[0])
        for i in failed:
            self._restart(i)
            self._own["episodes_lost"] += self._sizes[i]
            self._cut[i] = list(range(self._sizes[i]))
        out = clone_td(self._out)
        for i in failed:
            sl = self._slice(i)
            truncate_(out, self._last[sl], sl, self._tree)
        self._last = out.exclude(NEXT)
        self.last_cut = np.array([o + j for o, cut in zip(self.offsets, self._cut) for j in cut], dtype=np.int64)
        return out

    # -- split phase -----------------------------------------------------------------------------------------
    def root(self, k: int) -> TensorDict:
        """Worker ``k``'s current step to act on (after :meth:`reset`, or its latest finished step), batch
        ``[n_k]``: the root keys of a step (groups' observation, mask, action mask; shared), a copy."""
        if self._last is None:
            raise RuntimeError("call reset() before root()")
        return self._root(k).clone()

    def send(self, actions: TensorDict, workers: Sequence[int]) -> None:
        """Starts a step on ``workers`` and returns at once (:meth:`poll` reports when each finished).

        Args:
            actions: batch ``[sum of n_k over workers]``: ``{group: {"action": [n, A, ...]}}``, the workers'
                action slices concatenated in the order of ``workers`` (extra keys are ignored).
            workers: distinct worker indices, none of them in flight.

        Raises:
            ValueError: a worker is in flight already or named twice, or ``actions`` has the wrong batch.
        """
        if self._last is None:
            raise RuntimeError("call reset() before send()")
        workers = [int(k) for k in workers]
        busy = [k for k in workers if k in self._sent]
        if busy or len(set(workers)) != len(workers):
            raise ValueError(f"workers {busy or workers} are in flight or named twice; poll() them first")
        total = sum(self._sizes[k] for k in workers)
        if actions.batch_size[:1] != torch.Size([total]):
            raise ValueError(f"actions have batch {list(actions.batch_size)}; workers {workers} have {total} envs")
        sources = [actions.get(key) for key, _ in self._act_leaves]
        start = 0
        for k in workers:  # the worker reads its slice only after the "step" message: no step of its own races this
            n, first = self._sizes[k], self.offsets[k]
            for (_, buf), src in zip(self._act_leaves, sources):
                buf[first:first + n].copy_(src[start:start + n])
            start += n
        for k in workers:
            self._sent[k] = time.monotonic()
            try:
                self._workers[k].conn.send(("step", None))
            except (OSError, ValueError):  # the process is gone: poll() reports it at once
                self._early[k] = ("dead", None)

    def poll(self, timeout_s: float | None = 0.0) -> list[int]:
        """The in-flight workers whose step finished, waiting up to ``timeout_s`` for the first one.

        Every worker finished by the time the call returns is reported (not just the first). A worker that
        died, raised, or has not answered ``step_timeout_s`` after its own :meth:`send` is restarted (or raises
        :class:`EnvWorkerFault` in strict mode) and reported finished, its envs ending truncated exactly as in
        :meth:`step`. Take each reported worker's output with :meth:`result`.

        Args:
            timeout_s: longest wait for a first finished worker; 0 only looks; None waits until one finishes
                (at most until the earliest step timeout).

        Returns:
            The finished workers' indices, sorted; ``[]`` when none finished in time or none is in flight.
        """
        if not self._sent:
            return []
        limit = self.config.step_timeout_s
        end = None if timeout_s is None else time.monotonic() + max(0.0, timeout_s)
        while True:
            replies = dict(self._early)
            self._early.clear()
            watched = {}
            for k in self._sent:
                if k not in replies:
                    w = self._workers[k]
                    watched[w.conn] = watched[w.proc.sentinel] = k
            now = time.monotonic()
            until = min(self._sent.values()) + limit  # the first step timeout ends any wait
            if end is not None:
                until = min(until, end)
            wait_s = 0.0 if replies else max(0.0, until - now)
            for k in sorted({watched[obj] for obj in wait(list(watched), wait_s)}):
                replies[k] = self._receive(k)
            now = time.monotonic()
            for k, sent in self._sent.items():
                if k not in replies and now - sent >= limit:
                    replies[k] = ("timeout", None)
            if replies or end is not None and now >= end:
                break
        for k in sorted(replies):
            self._finish(k, replies[k])
        return sorted(replies)

    def result(self, k: int) -> TensorDict:
        """Takes worker ``k``'s finished step (reported by :meth:`poll`): batch ``[n_k]``, the layout of
        :meth:`step`'s output (``"next"`` plus the next step to act on), a copy the caller owns. Each finished
        step is taken once."""
        try:
            return self._results.pop(k)
        except KeyError:
            raise ValueError(f"worker {k} has no finished step to take (send() it, then poll())") from None

    def _finish(self, k: int, reply) -> None:
        """Files worker ``k``'s reply: its output, or (a fault) its restart and truncated envs."""
        del self._sent[k]
        if self._accept(k, reply):
            out = clone_td(self._views[k])
        else:
            if not self.config.restart:
                self._raise(k)
            self._restart(k)
            self._own["episodes_lost"] += self._sizes[k]
            self._cut[k] = list(range(self._sizes[k]))
            out = clone_td(self._views[k])  # the root: the restarted env's first observations
            truncate_(out, self._root(k), slice(None), self._tree)
        self._results[k] = out
        self._roots[k] = out.exclude(NEXT)

    def cut(self, k: int) -> list[int]:
        """The envs of worker ``k`` (indices within it) whose episode its last finished step cut: a lenient
        repair inside it, or all of them when it was restarted (:attr:`last_cut` for :meth:`step`)."""
        return list(self._cut[k])

    def _receive(self, k: int):
        w = self._workers[k]
        try:
            return w.conn.recv() if w.conn.poll() else ("dead", None)
        except (EOFError, OSError):
            return ("dead", None)

    def _root(self, k: int) -> TensorDict:
        root = self._roots.get(k)
        return root if root is not None else self._last[self._slice(k)]

    def _slice(self, k: int) -> slice:
        return slice(self.offsets[k], self.offsets[k] + self._sizes[k])

    def close(self) -> None:
        """Stops every worker; idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(("close", None))
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(2)
            w.kill()
        self._finalizer.detach()

    # -- faults ----------------------------------------------------------------------------------------------
    def _accept(self, i: int, reply) -> bool:
        kind, payload, *cut = reply
        if kind == "ok":
            self._worker_counters[i] = payload
            self._cut[i] = cut[0] if cut else []  # worker-local indices of the envs its step cut
            return True
        self._own[{"timeout": "step_timeouts", "dead": "worker_crashes"}.get(kind, "worker_errors")] += 1
        self._fault = (kind, payload)
        return False

    def _raise(self, i: int, restarts_spent: bool = False) -> None:
        kind, payload = self._fault
        last = str(payload).strip().splitlines()[-1:] or [""]
        what = {"timeout": f"did not answer within {self.config.step_timeout_s} s", "dead": "died",
                "start": f"could not be restarted ({last[0]})"}.get(kind, f"raised {last[0]}")
        first, n = self.offsets[i], self._sizes[i]
        self.close()
        then = (f"; the pool has no restart left (it allows {self.config.max_restarts} over its life, for all its "
                f"workers): mend the env, or lower what fails it" if restarts_spent else ". Strict mode stops here; "
                "rollout.check='lenient' restarts the worker and counts the lost episodes")
        fault = EnvWorkerFault(f"env worker {i} (envs {first}..{first + n - 1} of the batch) {what}{then}")
        fault.env_output = kind == "error" and last[0].startswith(f"{EnvOutputError.__module__}.EnvOutputError:")
        raise fault

    def _handshake(self, w: _Worker) -> tuple[str, int]:
        kind, *payload = _collect([w], self.config.start_timeout_s)[w.index]
        if kind != "ready":
            w.kill()
            raise RuntimeError(f"env worker {w.index} failed to start ({kind}): {payload[0] if payload else ''}")
        return payload[0], payload[1]

    def _send_buffers(self, w: _Worker) -> None:
        sl = self._slice(w.index)
        w.conn.send((self._act[sl], self._out[sl]))

    def _restart(self, i: int) -> None:
        """Replaces worker ``i`` by a fresh process and resets it (its root slice of the buffer is written)."""
        old = self._workers[i]
        old.kill()
        for k, v in self._worker_counters[i].items():
            self._past_counters[k] = self._past_counters.get(k, 0) + v
        self._worker_counters[i] = {}
        while True:
            if self._own["env_restarts"] >= self.config.max_restarts:
                self._raise(i, restarts_spent=True)
            self._own["env_restarts"] += 1
            w = _Worker(i, old.factory, self._ctx, self.config)
            w.incarnation = old.incarnation + 1
            self._workers[i], old = w, w
            try:
                tree_json, n = self._handshake(w)
            except RuntimeError as err:  # the last failure is the one a spent pool names
                self._fault = ("start", str(err))
                continue
            if tree_json != self._tree_json or n != self._sizes[i]:
                raise RuntimeError(f"restarted env worker {i} has a different tree or number of envs")
            try:
                self._send_buffers(w)
            except (OSError, ValueError):  # died right after its handshake
                w.kill()
                continue
            seed = None if self._seed is None else int(
                np.random.SeedSequence([self._seed, i, w.incarnation]).generate_state(1, np.uint32)[0])
            if self._accept(i, _command([w], lambda w: ("reset", seed), self.config.step_timeout_s)[i]):
                return
            w.kill()


__all__ = ["EnvWorkerConfig", "EnvWorkerFault", "EnvWorkerPool", "step_template"]
