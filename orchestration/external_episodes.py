"""External episodes to fragments: what the server (:mod:`orchestration.external_server`) records.

Each ``act`` request of an external episode is one step; its consequences (rewards, agents that left, the
next observation of each agent) arrive with the episode's next request or its ``end``. A running episode
holds a *lane*: a :class:`core.buffers.FragmentBuilder` of one env row (``E = 1``) with its own worker id,
so fragments ``[1, T]`` reach the learners through the usual inbox and ledger. A lane outlives episodes:
the next episode that takes it continues its row (``("next", "done")`` separates them, as in any env).

Steps per episode (the :mod:`core.layout` of a one-env batched env, ``A`` = group capacity)::

    open   acted on, consequences unknown:  group observation [1, A, *obs], mask [1, A], action_mask?,
           action [1, A, *act], log_prob [1, A, 1]; shared [1, *]
    held   complete, not yet in the lane: kept one step back so that a disconnect can still mark it truncated
    lane   complete steps; every ``T`` of them make a fragment

Rules (docs/external-protocol.md): an agent's next observation is the one it sends with the episode's next
request; an agent absent there (or a truncated end without final observations) bootstraps from its own
observation, counted in ``approx_bootstraps``. A disconnect or a refused request ends the episode: the held
step becomes the last one, truncated; the open step's consequences are unknown, so it is dropped and counted
(``steps_lost``), and the episode counts as ``episodes_cut``. A fragment's policy version is the oldest of
its steps (each step keeps its own behaviour log-probability, which is what the losses read).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

import torch

from adapters.external.codec import Request, TreeCodec, where_slots
from core.buffers import FragmentBuilder
from core.layout import (ACTION, ACTION_MASK, DONE, LOG_PROB, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED,
                         TRUNCATED)
from orchestration.episode_records import episode_records
from orchestration.assignment import GroupAssignment
from orchestration.builder import worker_id_of

# -- lanes and episodes ---------------------------------------------------------------------------------------
class Lanes:
    """Lanes (one-row fragment builders) lent to running episodes, and the counters of the recording.

    Args:
        codec: the run's tree.
        assignment: group -> policies (external groups have one policy each).
        fragment_length: ``T``.
        deliver: called with ``(fragment [1, T], meta, completed episodes)`` for every fragment, from the
            connection thread that completed it.
    """

    def __init__(self, codec: TreeCodec, assignment: Mapping[str, GroupAssignment], fragment_length: int,
                 deliver: Callable[[Any, dict, dict], None]) -> None:
        split = [g for g, a in assignment.items() if a.single is None]
        if split:
            raise ValueError(f"external environments need one policy per group; groups {split} are split between "
                             f"policies (check policy_mapping)")
        self.codec, self.assignment, self.fragment_length, self.deliver = codec, dict(assignment), fragment_length, deliver
        self.policy_of = {g: a.single for g, a in assignment.items()}
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._builders: list[FragmentBuilder] = []
        self._versions: list[tuple[dict[str, int], dict[str, int]]] = []
        self.counters = dict(episodes_started=0, episodes_completed=0, episodes_cut=0, steps_recorded=0,
                             steps_lost=0, approx_bootstraps=0)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def take(self) -> int:
        with self._lock:
            self.counters["episodes_started"] += 1
            if self._free:
                return self._free.pop()
            lane = len(self._builders)
            self._builders.append(FragmentBuilder(1, worker_id=worker_id_of(lane, 0),
                                                  group_sizes={g: s.capacity for g, s in self.codec.groups.items()}))
            self._versions.append(({}, {}))  # group -> version: the oldest that acted; for all-masked steps
            return lane

    def give_back(self, lane: int) -> None:
        with self._lock:
            self._free.append(lane)

    def push(self, lane: int, step: dict, versions: Mapping[str, int]) -> None:
        """Adds a complete step to ``lane`` (held by the calling thread's episode); builds the fragment at ``T``.
        ``versions``: group -> the version that acted for it, or, for a group none of whose agents acted at this
        step, its policy's version then: a fragment's label is the oldest version that acted for the group, the
        newest such version only where nothing of the group acted in the whole fragment (all masked)."""
        builder, (acted, idle) = self._builders[lane], self._versions[lane]
        for g, v in versions.items():
            if bool(step[g][MASK].any()):
                acted[g] = min(acted.get(g, v), v)
            else:
                idle[g] = max(idle.get(g, v), v)
        builder.add_step_(step)
        self.count("steps_recorded")
        if len(builder) < self.fragment_length:
            return
        versions = {**idle, **acted}
        fragment = builder.build(versions)
        acted.clear()
        idle.clear()
        episodes = episode_records(builder.pop_completed_episodes(), self.assignment)
        labels: dict[str, int] = {}
        for g, v in versions.items():  # groups of one policy: the oldest version that acted for any of them
            labels[self.policy_of[g]] = min(labels.get(self.policy_of[g], v), v)
        meta = {"fragment_id": int(fragment.get("fragment_id")[0, 0]), "worker_id": builder.worker_id,
                "sequence": builder.sequence - 1, "env_steps": self.fragment_length, "policy_versions": labels}
        self.deliver(fragment, meta, episodes)

    @property
    def created(self) -> int:
        """Lanes made so far (at most the most episodes that ever ran at once)."""
        return len(self._builders)

    @property
    def idle(self) -> int:
        """Lanes no episode holds now."""
        return len(self._free)

    @property
    def pending_steps(self) -> int:
        """Steps recorded in lanes but not yet in a fragment."""
        return sum(len(b) for b in self._builders)


class Episode:
    """One external episode on a lane (module docstring); used by one connection thread at a time."""

    def __init__(self, lanes: Lanes, name: str) -> None:
        self.lanes, self.name = lanes, name
        self.lane = lanes.take()
        self.open: dict | None = None
        self.open_versions: dict[str, int] = {}
        self.open_slots: dict[str, set[int]] = {}  # group -> slots of the agents that acted at the open step
        self.held: tuple[dict, dict[str, int]] | None = None
        self.waiting = False  # an answer is owed for this episode's last request

    # -- steps ------------------------------------------------------------------------------------------------
    def consequences(self, request: Request) -> None:
        """Completes the open step with ``request`` (the next step's observations, the rewards, who left)."""
        if self.open is None:
            return
        nxt: dict[str, Any] = {}
        approx = 0
        now_slots = request.slots()
        for g, (term, trunc, done) in request.left.items():
            entry = self.open[g]
            was, obs = entry[MASK], request.observation[g]
            if not self.open_slots[g] <= now_slots[g]:  # an agent of the open step is silent now (rare)
                now = request.mask[g]
                approx += int((was & ~now & ~term.squeeze(-1)).sum())
                obs = where_slots(now, obs, entry[OBSERVATION])
            # else: the request's observation already is the next one everywhere (zeros where nobody was)
            nxt[g] = {OBSERVATION: obs, REWARD: request.reward[g], TERMINATED: term, TRUNCATED: trunc, DONE: done,
                      MASK: was}
        if approx:
            self.lanes.count("approx_bootstraps", approx)
        self._complete(nxt, request.shared, False, False)

    def act(self, request: Request, outputs: Mapping[str, Mapping[str, Any]], versions: Mapping[str, int]) -> None:
        """Opens the step just answered: group -> ``{action, log_prob}`` of the inference service."""
        step: dict[str, Any] = {}
        for g in self.lanes.codec.groups:
            entry = {OBSERVATION: request.observation[g], MASK: request.mask[g], ACTION: outputs[g][ACTION],
                     LOG_PROB: outputs[g][LOG_PROB]}
            if g in request.action_mask:
                entry[ACTION_MASK] = request.action_mask[g]
            step[g] = entry
        if request.shared is not None:
            step[SHARED] = request.shared
        self.open, self.open_versions, self.open_slots = step, dict(versions), request.slots()

    def end(self, outcome: str, reward: Mapping[str, torch.Tensor],
            final: Mapping[str, tuple[Any, torch.Tensor]]) -> None:
        """Ends the episode (``outcome``: terminated or truncated); gives the lane back."""
        if self.open is not None:
            terminated = outcome == "terminated"
            nxt, approx = {}, 0
            for g, entry in ((g, self.open[g]) for g in self.lanes.codec.groups):
                present = entry[MASK]
                obs, given = final[g]
                if not terminated:
                    approx += int((present & ~given).sum())
                flag = torch.full((*present.shape, 1), True, dtype=torch.bool)
                nxt[g] = {OBSERVATION: where_slots(given, obs, entry[OBSERVATION]), REWARD: reward[g],
                          TERMINATED: flag & terminated, TRUNCATED: flag & (not terminated), DONE: flag, MASK: present}
            if approx:
                self.lanes.count("approx_bootstraps", approx)
            self._complete(nxt, self.open.get(SHARED), terminated, not terminated)
        self._flush()
        self.lanes.count("episodes_completed")
        self.lanes.give_back(self.lane)

    def cut(self) -> None:
        """Ends the episode after a disconnect or a refused request (module docstring); gives the lane back."""
        if self.open is not None:
            self.lanes.count("steps_lost")
            self.open = None
        if self.held is not None:
            step, versions = self.held
            _truncate_(step)
            self.lanes.push(self.lane, step, versions)
            self.held = None
        self.lanes.count("episodes_cut")
        self.lanes.give_back(self.lane)

    def _complete(self, nxt: dict, shared_next: Any, terminated: bool, truncated: bool) -> None:
        step = self.open
        step[NEXT] = {**nxt, DONE: _FLAG[terminated or truncated], TERMINATED: _FLAG[terminated],
                      TRUNCATED: _FLAG[truncated]}
        if SHARED in step:
            step[NEXT][SHARED] = shared_next if shared_next is not None else step[SHARED]
        if self.held is not None:
            self.lanes.push(self.lane, *self.held)
        self.held, self.open = (step, self.open_versions), None

    def _flush(self) -> None:
        if self.held is not None:
            self.lanes.push(self.lane, *self.held)
            self.held = None


_FLAG = {b: torch.full((1, 1), b) for b in (False, True)}
"""Env-level flags ``[1, 1]``, shared by every step (a step's leaves are never changed in place, and
:class:`core.buffers.FragmentBuilder` stacks a leaf shared across steps into a fresh tensor)."""


def _truncate_(step: dict) -> None:
    """Marks a complete step the last of its episode, truncated (env level and every agent slot)."""
    nxt = step[NEXT]
    for key, value in list(nxt.items()):
        if isinstance(value, dict):
            cut = ~value[DONE]  # every slot, as FragmentBuilder's end_episodes does
            value[TRUNCATED] = value[TRUNCATED] | cut
            value[DONE] = value[DONE] | cut
    nxt[TRUNCATED] = nxt[TRUNCATED] | ~nxt[DONE]
    nxt[DONE] = torch.ones_like(nxt[DONE])


__all__ = ["Episode", "Lanes"]
