"""Self-play against past selves (seed 002's opponent pools; on by default for zero-sum self-play).

Plain self-play (one policy in every seat of a two-player game) tends to collapse onto a few lines of play
that it only ever meets against itself. A training actor therefore hands the policy of such a group to
:class:`PastSelves`, a stand-in with the policy's acting interface. In a fraction of the games (drawn per env
at every episode start) one seat, drawn uniformly, is played by a frozen *past self*: a snapshot of the
policy's weights from a pool that grows every ``snapshot_every`` versions, starting with the initial weights
(about uniform play). The actor records that seat as absent (``mask`` False), so learners train only on the
seats the current policy played; the current policy still plays every seat of the other games.

The pool lives in the actor (each rollout worker keeps its own, from the weights it receives: nothing is
copied per game or through the object store), is drawn from once per fragment (one frozen opponent per
fragment, uniformly among the snapshots), and is part of the actor's checkpointed state.

Usage (what :func:`orchestration.builder.build_actor` does)::

    stand_in = PastSelves(policy, PastSelvesConfig(), seed=0)
    actor = Actor(env, {"player": stand_in}, assignment)    # loads weights through stand_in.load_weights_
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from core.layout import ACTION, MASK
from core.policies import GroupPolicy
from orchestration.config import PastSelvesConfig


def _where_rows(take: torch.Tensor, new, old):
    """``new`` where ``take`` ``[E, A]``, ``old`` elsewhere, for a tensor or a nested dict of ``[E, A, ...]``."""
    if isinstance(new, dict):
        return {k: _where_rows(take, new[k], old[k]) for k in new}
    return torch.where(take.reshape(*take.shape, *(1,) * (new.dim() - 2)), new, old)


class PastSelves:
    """``policy`` (the actor's copy of the learning policy) playing with past selves in some games.

    Args:
        policy: a feed-forward :class:`core.policies.GroupPolicy` of a group with >= 2 seats.
        config: fraction of games, snapshot schedule, pool size.
        seed: seeds the draws (which games, which seat, which snapshot) and the past selves' sampling.
    """

    recurrent = False
    reads_episode_starts = True  # seats are drawn again where an episode starts

    def __init__(self, policy: GroupPolicy, config: PastSelvesConfig, *, seed: int = 0) -> None:
        if policy.recurrent or policy.num_agents < 2:
            raise ValueError(f"group {policy.group_name}: past selves need a feed-forward policy of >= 2 seats")
        self.policy, self.config = policy, config
        self.num_agents, self.defers_log_prob, self.group_name = policy.num_agents, policy.defers_log_prob, \
            policy.group_name
        self.opponent = copy.deepcopy(policy)
        self.generator = torch.Generator().manual_seed(seed)
        self.pool: list[tuple[int, TensorDictBase]] = [(0, self.weights())]
        """``(version, weights)`` of the snapshots, oldest first."""
        self.version = self.opponent_version = 0
        self.seat = None  # [E] int64: the seat a past self plays in each env (-1: none); drawn at episode starts
        self.games = self.past_self_games = 0  # games started, and those with a past self in a seat (this process)

    def weights(self) -> TensorDictBase:
        """A detached copy of the current policy's weights."""
        return TensorDict.from_module(self.policy).detach().clone()

    def load_weights_(self, version: int, weights: TensorDictBase, force: bool = False) -> None:
        """Loads the newest weights (at a fragment boundary), adds a snapshot when one is due, and draws the past
        self of the next fragment. A forced load of the version it holds (a Ray sampler's first load) draws
        nothing, and makes these weights the pool's initial ones, so a run takes the same past selves on every
        backend."""
        with torch.no_grad():
            TensorDict.from_module(self.policy).update_(weights)
        if force and int(version) == self.version:
            if len(self.pool) == 1 and self.pool[0][0] == self.version:  # the initial weights are the learner's
                self.pool[0] = (self.version, self.weights())  # (a Ray worker built its module unseeded)
                with torch.no_grad():
                    TensorDict.from_module(self.opponent).update_(self.pool[0][1])
            return
        self.version = int(version)
        if self.version - self.pool[-1][0] >= self.config.snapshot_every:
            self.pool.append((self.version, self.weights()))
            if len(self.pool) > self.config.pool_size:
                del self.pool[1]  # the initial weights stay: the most different opponent
        pick = int(torch.randint(len(self.pool), (), generator=self.generator))
        self.opponent_version, snapshot = self.pool[pick]
        with torch.no_grad():
            TensorDict.from_module(self.opponent).update_(snapshot)

    def _draw_seats_(self, rows: int, start: torch.Tensor | None) -> None:
        """Draws, for the envs starting an episode, whether a past self plays and which seat."""
        if self.seat is None or self.seat.shape[0] != rows:
            self.seat, start = torch.full((rows,), -1, dtype=torch.int64), torch.ones(rows, dtype=torch.bool)
        if start is None or not bool(start.any()):
            return
        played = torch.rand(rows, generator=self.generator) < self.config.fraction
        seat = torch.randint(self.num_agents, (rows,), generator=self.generator)
        start = start.reshape(-1)
        self.games += int(start.sum())
        self.past_self_games += int((start & played).sum())
        self.seat = torch.where(start, torch.where(played, seat, -1), self.seat)

    def act_step(self, obs, shared=None, generator: torch.Generator | None = None, deterministic: bool = False,
                 recurrent_state: torch.Tensor | None = None, episode_start: torch.Tensor | None = None,
                 with_value: bool = True, with_log_prob: bool = True) -> dict:
        """The policy's :meth:`core.policies.GroupPolicy.act_step`, with the past self's actions on its seats and
        ``"mask"`` False there (not trained on). The recorded log-probabilities or head parameters stay the
        current policy's (finite, and masked out)."""
        out = self.policy.act_step(obs, shared, generator, deterministic, None, None, with_value, with_log_prob)
        leaf = out[ACTION]
        while isinstance(leaf, dict):
            leaf = next(iter(leaf.values()))
        self._draw_seats_(leaf.shape[0], episode_start)
        taken = self.seat.unsqueeze(-1) == torch.arange(self.num_agents)  # [E, A]
        if not bool(taken.any()):
            return out
        past = self.opponent.act_step(obs, shared, self.generator, False, with_value=False, with_log_prob=False)
        out = dict(out)
        out[ACTION] = _where_rows(taken, past[ACTION], out[ACTION])
        present = obs.get(MASK, None)
        out[MASK] = ~taken if present is None else present & ~taken
        return out

    def log_prob_from_params(self, params: torch.Tensor, action, action_mask: torch.Tensor | None = None):
        """The current policy's (:meth:`core.policies.GroupPolicy.log_prob_from_params`)."""
        return self.policy.log_prob_from_params(params, action, action_mask)

    # -- state (checkpoints) -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The pool, the seats of the running games and the generator: ``{"tensors", "json"}``."""
        tensors = {"rng": self.generator.get_state()}
        if self.seat is not None:
            tensors["seat"] = self.seat.clone()
        for version, weights in self.pool:
            tensors.update({f"pool/{version}/{'/'.join(k) if isinstance(k, tuple) else k}": v
                            for k, v in weights.items(True, True)})
        return {"tensors": tensors, "json": {"pool": [v for v, _ in self.pool], "version": self.version,
                                             "opponent_version": self.opponent_version,
                                             "games": [self.games, self.past_self_games]}}

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state`."""
        tensors, meta = state["tensors"], state["json"]
        self.generator.set_state(tensors["rng"])
        self.seat = tensors["seat"].clone() if "seat" in tensors else None
        template = self.weights()
        self.pool = []
        for version in meta["pool"]:
            head = f"pool/{version}/"
            snapshot = template.clone()
            for key in snapshot.keys(True, True):
                snapshot.set(key, tensors[head + ("/".join(key) if isinstance(key, tuple) else key)].clone())
            self.pool.append((int(version), snapshot))
        self.version, self.opponent_version = int(meta["version"]), int(meta["opponent_version"])
        self.games, self.past_self_games = (int(n) for n in meta.get("games", (0, 0)))  # older checkpoints: none
        snapshot = dict(self.pool)[self.opponent_version]
        with torch.no_grad():
            TensorDict.from_module(self.opponent).update_(snapshot)


def past_selves_report(actor) -> dict[str, int]:
    """An actor's past selves (empty without): the largest pool, the games started and those with a past self."""
    stand_ins = [p for p in actor.policies.values() if isinstance(p, PastSelves)]
    if not stand_ins:
        return {}
    return {"pool_size": max(len(p.pool) for p in stand_ins), "games": sum(p.games for p in stand_ins),
            "past_self_games": sum(p.past_self_games for p in stand_ins)}


__all__ = ["PastSelves", "PastSelvesConfig", "past_selves_report"]
