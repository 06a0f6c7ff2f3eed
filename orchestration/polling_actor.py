"""PollingActor (seed 004): acts for the env processes of an :class:`~adapters.env_worker.EnvWorkerPool` that
are ready, so a slow or hung process holds back only its own envs.

An :class:`~orchestration.actor.Actor` on a pool steps in lock-step: every step waits for all K processes,
and the slowest sets everyone's pace. A PollingActor drives the pool's split-phase API instead: each
:meth:`PollingActor.step` takes the steps of the processes that finished, concatenates the observations of
every process that waits for an action, runs ONE batched forward per group (:meth:`Actor.act`), sends each
process its slice of the actions and returns while they run.

Every env process is its own fragment stream: its own :class:`~core.buffers.FragmentBuilder`, episode ids
and worker id (``worker_ids[k]``). A fragment is one process's ``[n_k, T]``; :meth:`PollingActor.collect`
returns the next completed fragment of any stream and :meth:`PollingActor.fragment_meta` its delivery
metadata, whose ``worker_id`` is that stream's. Each stream delivers its fragments in sequence order with
no gap, as the learners' per-worker ledger (:mod:`orchestration.inbox`) requires of one producer.

Policy versions: new weights arrive between :meth:`collect` calls, a fragment boundary for one stream only;
the others are mid-fragment and act with the new weights from their next step. A fragment records, per
policy, the OLDEST version that acted in any of its steps (``meta["policy_versions"]`` and the fragment's
``policy_version``), so the staleness rule never under-states a lag; the behaviour log-probabilities are
those of the weights that acted at each step.

Usage loop::

    pool = EnvWorkerPool([factory] * 4)
    actor = PollingActor(pool, policies, assign(pool.tree), fragment_length=64, seed=0, worker_ids=[0, 1, 2, 3])
    fragment = actor.collect()                          # one process's [n_k, T]
    meta = actor.fragment_meta(fragment)                # meta["worker_id"]: that process's stream
    learner.receive(fragment, meta)
    stats.add(meta["worker_id"], meta["sequence"], actor.completed_episodes())
    actor.set_weights(pid, *learner.weights())          # acted with from each process's next step
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from core.buffers import FragmentBuilder
from core.layout import DONE, FRAGMENT_ID, NEXT
from core.policies import GroupPolicy
from orchestration.actor import Actor
from orchestration.episode_records import episode_records
from orchestration.assignment import GroupAssignment


@dataclass(eq=False)
class _Stream:
    """One env process's fragment stream."""

    index: int
    """The process's index in the pool."""
    worker_id: int
    builder: FragmentBuilder
    obs: TensorDictBase
    """The step to act on next, batch ``[n_k]`` (a pool result: ``"next"`` rides along unread)."""
    done: torch.Tensor
    """``[n_k, 1]`` bool: envs whose episode starts at the step to act on."""
    rnn: dict = field(default_factory=dict)
    """``(group, policy id) -> [n_k, A, H]`` recurrent state (recurrent policies only)."""
    entries: dict | None = None
    """The step in flight (recorded when its result arrives); None while the process waits for an action."""
    versions: dict[str, int] = field(default_factory=dict)
    """Per policy, the oldest version that acted in the fragment under way."""
    delivered: int = 0
    """Fragments :meth:`PollingActor.collect` returned (= the stream's next sequence number to deliver)."""
    steps: int = 0
    """Steps recorded (each ``n_k`` env steps)."""


class PollingActor:
    """Acts in the env processes of ``pool`` as they become ready; one fragment stream per process (module doc).

    Args:
        pool: an :class:`adapters.env_worker.EnvWorkerPool` (reset here with ``seed``).
        policies: policy id -> module acting for the groups mapped to it (this actor's own copies).
        assignment: group -> :class:`orchestration.assignment.GroupAssignment`.
        fragment_length: steps per fragment, ``T``.
        seed: seeds the pool reset (process ``k`` with ``seed + offsets[k]``) and the sampling generator.
        worker_id: this actor's own id (fleet reports, env counters); stream ids come from ``worker_ids``.
        worker_ids: one worker id per process, distinct across the whole fleet (default
            ``worker_id + k``: distinct within this actor only, so a fleet of several must pass them).
        deterministic: act with the policies' modes: True for all, or the ids of those that should.
        poll_timeout_s: longest wait for a process when every process is stepping (None: until one finishes
            or hits its step timeout); :meth:`step` returns ``[]`` when it ran out.
    """

    def __init__(self, pool, policies: Mapping[str, GroupPolicy], assignment: Mapping[str, GroupAssignment], *,
                 fragment_length: int = 128, seed: int = 0, worker_id: int = 0,
                 worker_ids: Sequence[int] | None = None, deterministic: bool | Collection[str] = False,
                 poll_timeout_s: float | None = None) -> None:
        if fragment_length < 1:
            raise ValueError(f"fragment_length must be >= 1, got {fragment_length}")
        k = pool.num_workers
        ids = [int(w) for w in worker_ids] if worker_ids is not None else [worker_id + i for i in range(k)]
        if len(ids) != k or len(set(ids)) != k:
            raise ValueError(f"need {k} distinct worker ids (one per env process), got {ids}")
        # The acting core: an Actor over the whole pool (constructing it resets the pool with `seed`). Only its
        # act() and build_fragment(), generator, policies and versions are used; its own step() never runs.
        self.core = Actor(pool, policies, assignment, fragment_length=fragment_length, seed=seed,
                          worker_id=worker_id, deterministic=deterministic)
        self.env = pool
        self.fragment_length = fragment_length
        self.worker_id = worker_id
        self.poll_timeout_s = poll_timeout_s
        self.streams = [_Stream(i, ids[i], FragmentBuilder(n, worker_id=ids[i]), pool.root(i),
                                torch.ones(n, 1, dtype=torch.bool)) for i, n in enumerate(pool.sizes)]
        self.env_steps = 0
        """Env steps recorded (each process step counts its ``n_k`` envs)."""
        self._recurrent = any(p.recurrent for p in self.core.policies.values())
        self._queue: deque[tuple[_Stream, TensorDict, dict, dict]] = deque()  # built, not yet collected
        self._episodes: list[dict[str, np.ndarray]] = []  # of the fragments collected since completed_episodes()
        self._last: tuple[_Stream, dict] | None = None  # the stream and meta of the fragment collected last

    # -- what a fleet reads from an actor ----------------------------------------------------------------
    @property
    def policies(self) -> dict[str, GroupPolicy]:
        return self.core.policies

    @property
    def assignment(self) -> dict[str, GroupAssignment]:
        return self.core.assignment

    @property
    def versions(self) -> dict[str, int]:
        """Policy id -> version of the weights this actor acts with now."""
        return self.core.versions

    @property
    def worker_ids(self) -> list[int]:
        """The streams' worker ids, by process."""
        return [s.worker_id for s in self.streams]

    @property
    def builders(self) -> list[FragmentBuilder]:
        """The streams' fragment builders, by process."""
        return [s.builder for s in self.streams]

    @property
    def builder(self) -> FragmentBuilder:
        """The builder of the stream whose fragment :meth:`collect` returned last (process 0's before any);
        ``builder.sequence`` is one stream's count: a fleet should read :meth:`sequences`."""
        return (self._last[0] if self._last is not None else self.streams[0]).builder

    def sequences(self) -> dict[int, int]:
        """Worker id -> fragments delivered by that stream (its next sequence number)."""
        return {s.worker_id: s.delivered for s in self.streams}

    @property
    def process_steps(self) -> list[int]:
        """Steps each env process made (recorded), by process."""
        return [s.steps for s in self.streams]

    @property
    def queued(self) -> int:
        """Fragments built and waiting for :meth:`collect`."""
        return len(self._queue)

    # -- acting ------------------------------------------------------------------------------------------
    def step(self) -> list[int]:
        """One round: records the steps of the processes that finished (waiting for one when every process
        is stepping), then acts for every process waiting for an action in one batched forward per group,
        and sends each its actions. A stream that reaches ``fragment_length`` steps builds its fragment.

        Returns:
            The indices of the processes acted for (sorted).
        """
        waiting = any(s.entries is None for s in self.streams)
        for k in self.env.poll(0.0 if waiting else self.poll_timeout_s):
            self._record(self.streams[k], self.env.result(k), self.env.cut(k))
        ready = [s for s in self.streams if s.entries is None]
        if ready:
            self._act(ready)
        return [s.index for s in ready]

    def _act(self, ready: list[_Stream]) -> None:
        if len(ready) == 1:  # the common case once processes drift apart: nothing to concatenate or split
            obs, done, rnn = ready[0].obs, ready[0].done, dict(ready[0].rnn)
        else:
            obs = torch.cat([s.obs.exclude(NEXT) for s in ready])
            done = torch.cat([s.done for s in ready]) if self._recurrent else None
            rnn = _gather(ready) if self._recurrent else {}
        entries, actions = self.core.act(obs, done, rnn)
        self.env.send(actions, [s.index for s in ready])
        versions, start = self.core.versions, 0
        for s in ready:
            n = s.builder.num_envs
            s.entries = entries if len(ready) == 1 else _rows(entries, start, start + n)
            if self._recurrent:
                s.rnn = {key: h[start:start + n] for key, h in rnn.items() if h is not None}
            if len(s.builder) == 0:  # this step opens the stream's next fragment
                s.versions = dict(versions)
            else:
                s.versions = {pid: min(v, versions[pid]) for pid, v in s.versions.items()}
            start += n

    def _record(self, s: _Stream, out: TensorDict, cut: list[int]) -> None:
        nxt = out.get(NEXT)
        entries, s.entries = s.entries, None
        entries[NEXT] = nxt
        s.builder.add_step_(entries)
        if cut:  # episodes a fault ended (a restarted process, a lenient repair): not completed episodes
            s.builder.mark_cut_(cut)
        s.done = nxt.get(DONE)
        s.obs = out
        s.steps += 1
        self.env_steps += s.builder.num_envs
        if len(s.builder) == self.fragment_length:
            fragment = self.core.build_fragment(s.builder, s.versions)
            meta = {"fragment_id": int(fragment.get(FRAGMENT_ID)[0, 0]), "worker_id": s.worker_id,
                    "sequence": s.builder.sequence - 1, "policy_versions": dict(s.versions),
                    "env_steps": fragment.batch_size.numel()}
            # the episodes that ended in this fragment travel with it: collect() hands them out with it
            episodes = episode_records(s.builder.pop_completed_episodes(), self.core.assignment)
            self._queue.append((s, fragment, meta, episodes))

    @torch.no_grad()
    def collect(self) -> TensorDict:
        """Steps until a stream completed a fragment; returns the oldest completed one, ``[n_k, T]``."""
        while not self._queue:
            self.step()
        s, fragment, meta, episodes = self._queue.popleft()
        s.delivered += 1
        self._last = (s, meta)
        if episodes:
            self._episodes.append(episodes)
        return fragment

    def fragment_meta(self, fragment: TensorDictBase) -> dict[str, Any]:
        """The delivery metadata of the fragment :meth:`collect` returned last (:mod:`orchestration.inbox`):
        its id, its stream's worker id and sequence number, the oldest version of every policy that acted in
        it, and its env steps."""
        if self._last is None or int(fragment.get(FRAGMENT_ID)[0, 0]) != self._last[1]["fragment_id"]:
            raise ValueError("fragment_meta() describes the fragment collect() returned last")
        meta = self._last[1]
        return {**meta, "policy_versions": dict(meta["policy_versions"])}

    def completed_episodes(self) -> dict[str, np.ndarray]:
        """Episodes that ended in the fragments collected since the last call (:func:`episode_records` keys,
        in collection order)."""
        parts, self._episodes = self._episodes, []
        if not parts:
            return {}
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    # -- weights -----------------------------------------------------------------------------------------
    def set_weights(self, policy_id: str, version: int, weights: TensorDictBase, *, force: bool = False) -> bool:
        """:meth:`Actor.set_weights`: every process acts with them from its next step (module doc)."""
        return self.core.set_weights(policy_id, version, weights, force=force)

    def policy_weights(self, policy_id: str) -> TensorDictBase:
        """A copy of the weights this actor acts with for ``policy_id``."""
        return self.core.policy_weights(policy_id)

    # -- state -------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a resumed polling actor continues from: ``{"tensors": {...}, "json": {...}}``.

        Resumes: the sampling generator, the policy versions, ``env_steps``, and per stream its next
        sequence number (fragments delivered) and episode count, so the learners' ledgers see no gap and no
        repeat and episode ids stay unique. Does not resume: the envs (a pool cannot save them: every env
        starts a new episode), steps in flight, fragments under way or built but not yet collected (their
        sequence numbers are reused), running episode returns and recurrent states. The episodes open at
        :meth:`state` never end in the data; the resumed envs' episodes get new ids.
        """
        tensors = {"rng": self.core.generator.get_state()}
        for s in self.streams:
            tensors[f"episode_count/{s.index}"] = s.builder.tracker.episode_count.clone()
        meta = {"versions": dict(self.core.versions), "env_steps": self.env_steps, "worker_ids": self.worker_ids,
                "sequences": [s.delivered for s in self.streams], "env_state": False}
        return {"tensors": tensors, "json": meta}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Loads a :meth:`state` into a freshly built actor of the same config (weights are loaded separately).

        Raises:
            RuntimeError: this actor has stepped already.
            ValueError: the state is of other streams (other worker ids or process count, or envs per stream).
        """
        if self.env_steps or self.env.in_flight or any(len(s.builder) for s in self.streams):
            raise RuntimeError("load_state_() restores a freshly built PollingActor, before it steps")
        tensors, meta = state["tensors"], state["json"]
        if [int(w) for w in meta["worker_ids"]] != self.worker_ids:
            raise ValueError(f"state of streams {meta['worker_ids']}, this actor has {self.worker_ids}")
        for s in self.streams:  # another --rollout.num-envs: said before a fragment, as a size mismatch
            if (saved := tensors[f"episode_count/{s.index}"].shape[0]) != s.builder.tracker.num_envs:
                raise ValueError(f"size mismatch for the actor's envs: the checkpoint holds {saved} per env process, "
                                 f"this actor {s.builder.tracker.num_envs}")
        self.core.versions.update({k: int(v) for k, v in meta["versions"].items()})
        self.core.generator.set_state(tensors["rng"])
        self.env_steps = int(meta["env_steps"])
        for s, sequence in zip(self.streams, meta["sequences"]):
            s.builder.sequence = s.delivered = int(sequence)
            # the envs were not restored: each starts a new episode, with an id its old stream never used
            s.builder.tracker.episode_count = tensors[f"episode_count/{s.index}"] + 1


def _rows(tree: dict, start: int, stop: int) -> dict:
    """Rows ``start:stop`` of every ``[B, ...]`` leaf of a plain nested dict (views, no copy)."""
    return {k: _rows(v, start, stop) if isinstance(v, dict) else (None if v is None else v[start:stop])
            for k, v in tree.items()}


def _gather(ready: list[_Stream]) -> dict:
    """The ready streams' recurrent states concatenated per ``(group, policy)``; zeros for a stream without one
    yet (its envs start an episode, where the policy zeroes the state anyway)."""
    out = {}
    for key in {key for s in ready for key in s.rnn}:
        like = next(s.rnn[key] for s in ready if key in s.rnn)
        out[key] = torch.cat([s.rnn[key] if key in s.rnn else like.new_zeros(s.builder.num_envs, *like.shape[1:])
                              for s in ready])
    return out


__all__ = ["PollingActor"]
