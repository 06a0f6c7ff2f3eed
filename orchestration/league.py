"""Self-play against a league of frozen past selves: a trainer that drives a sub-trainer (seed 002).

Plain self-play needs no extra code: agents of one group share one policy by default (both connect-four
players are the same learner). A league keeps the opponent's policy frozen instead, and between iterations
replaces it by a member of a growing pool: snapshots of the learning policy taken every ``snapshot_every``
iterations, plus whatever the pool was seeded with. Opponents are drawn with prioritized fictitious self-play
(AlphaStar's PFSP): weight ``(1 - win_rate)^p``, so the ones the learner still loses to come up more often;
or uniformly, or always the latest snapshot (``sampling``).
The swap goes through :meth:`Trainer.set_weights`, which loads the opponent into every actor (in this process
or in Ray rollout workers) at a fragment boundary, before any of them produces the next fragment. In
synchronous mode the games counted against a member are games against it, on every backend; in asynchronous
mode on Ray, games that end in fragments already queued at the swap (at most ``RayConfig.queue_size`` per
worker) are credited to the new member.

Ratings: the learner and every member carry an Elo rating (:mod:`core.ratings`), updated once per iteration
from the games against the member played, taken as one match scored by their mean (``league_elo``,
``league_opponent_elo``; K ``core.ratings.MATCH_K``, as the role league rates): in a zero-sum game the
summed return is always 0, and a win rate depends on who was played; a rating does not. ``league_win_rate``
is the iteration's (its ``league_games`` games), ``league_opponent_win_rate`` that of every game against the
member so far (what PFSP weighs).

Usage::

    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", backend="local",   # or "ray"
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",))
    league = LeagueTrainer(build_trainer(config), learner="player", opponent="opponent")
    for _ in range(100):
        metrics = league.train()
"""

from __future__ import annotations

import copy
import difflib
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from tensordict import TensorDict, TensorDictBase

from core.ratings import INITIAL, MATCH_K, elo_update, score_from_return
from orchestration.builder import assignment_for

SAMPLINGS = ("pfsp", "uniform", "latest")
"""How :class:`LeagueTrainer` draws the next opponent from its pool."""


@dataclass
class Member:
    """One frozen opponent of the pool."""

    name: str
    weights: TensorDictBase
    games: int = 0
    score: float = 0.0
    """Sum of the learner's returns against this member (win +1, loss -1 in zero-sum games)."""
    rating: float = INITIAL
    """Elo rating (:mod:`core.ratings`); a snapshot starts with the learner's rating when it was taken."""

    @property
    def win_rate(self) -> float:
        """The learner's win rate against the member, from its mean return in [-1, 1]; 0.5 before any game."""
        return 0.5 if self.games == 0 else (self.score / self.games + 1.0) / 2.0


class LeagueTrainer:
    """Runs ``trainer`` iterations with the ``opponent`` policy frozen and swapped between iterations.

    Args:
        trainer: the sub-trainer (:class:`orchestration.trainer.Trainer`, any backend), whose ``opponent``
            policy is fixed (``TrainConfig.fixed_policies``).
        learner: id of the learning policy.
        opponent: id of the frozen opponent policy slot.
        snapshot_every: add a snapshot of the learner to the pool every N iterations.
        pfsp_power: exponent ``p`` of the PFSP weights; 0 draws uniformly.
        seed: seeds the opponent draws.
        sampling: how the next opponent is drawn: ``"pfsp"`` (weights ``(1 - win_rate)^pfsp_power``),
            ``"uniform"`` or ``"latest"`` (the newest member: self-play against the last snapshot).
    """

    def __init__(self, trainer, *, learner: str, opponent: str, snapshot_every: int = 5, pfsp_power: float = 2.0,
                 seed: int = 0, sampling: str = "pfsp") -> None:
        if opponent not in trainer.learners or trainer.learners[opponent].learns:
            raise ValueError(f"policy {opponent!r} must be a fixed policy (TrainConfig.fixed_policies); the "
                             f"policies are {sorted(trainer.learners)}")
        learning = sorted(pid for pid, lrn in trainer.learners.items() if lrn.learns)
        if learner not in learning:
            near = difflib.get_close_matches(learner, learning, n=1)
            raise ValueError(f"learner {learner!r} is no learning policy of the trainer; they are {learning}"
                             f"{f' (did you mean {near[0]!r}?)' if near else ''}")
        if sampling not in SAMPLINGS:
            raise ValueError(f"unknown opponent sampling {sampling!r}; choose one of {SAMPLINGS}")
        if not (isinstance(snapshot_every, numbers.Integral) and snapshot_every >= 1):
            raise ValueError(f"snapshot_every must be an int >= 1 (iterations between two snapshots), got "
                             f"{snapshot_every!r}")
        self.sampling = sampling
        self.trainer, self.learner, self.opponent = trainer, learner, opponent
        self.snapshot_every, self.pfsp_power = snapshot_every, pfsp_power
        self.generator = torch.Generator().manual_seed(seed)
        self.pool: list[Member] = [Member("initial", trainer.learners[opponent].weights()[1].clone())]
        self.current = self.pool[0]
        self.rating = INITIAL
        """The learner's Elo rating: one rating period per iteration, against the member it played."""

    def save_pool(self, directory: str | Path) -> list[Path]:
        """Writes every member of the pool as a snapshot (:mod:`orchestration.snapshots`) under ``directory``;
        any process can load them, e.g. :meth:`add_snapshot` of another league."""
        from orchestration.snapshots import save_snapshot

        module = self.trainer.learners[self.opponent].policy
        tree, config = self.trainer.tree, self.trainer.config.policy
        group = next(g for g, a in assignment_for(self.trainer.config, tree).items() if self.opponent in a.policies)
        written = []
        for i, member in enumerate(self.pool):
            policy = copy.deepcopy(module)
            with torch.no_grad():
                TensorDict.from_module(policy).update_(member.weights)
            written.append(save_snapshot(Path(directory) / f"{i:04d}-{member.name.replace('/', '_')}", policy, tree,
                                         group=group, policy_id=member.name, version=i, config=config,
                                         rating=member.rating))
        return written

    def add_member(self, weights: TensorDictBase, name: str | None = None) -> Member:
        """Adds in-memory ``weights`` (fitting the opponent slot, e.g. ``trainer.learners[learner].weights()[1]``)
        to the pool as a frozen member, without a round trip through disk as in :meth:`add_snapshot`: seeds a
        pool, or adds opponents from elsewhere. The weights are copied, so later changes to the given tensors
        do not reach the member. ``name`` defaults to ``"member/<index>"`` (``@2``... appended where taken)."""
        expected = self.pool[0].weights
        if set(weights.keys(include_nested=True, leaves_only=True)) != set(
                expected.keys(include_nested=True, leaves_only=True)) or any(
                weights[k].shape != v.shape for k, v in expected.items(include_nested=True, leaves_only=True)):
            raise ValueError(f"weights do not fit the opponent slot {self.opponent!r}")
        name = self._unique(name if name is not None else f"member/{len(self.pool)}")
        member = Member(name, weights.detach().clone())
        self.pool.append(member)
        return member

    def add_snapshot(self, path: str | Path, name: str | None = None) -> Member:
        """Adds a saved snapshot to the pool (its weights must fit the opponent slot) under ``name`` (default:
        its policy id; ``@2``, ``@3``... appended where the pool holds that name already), with the Elo rating
        :meth:`save_pool` recorded (its games and score were against another learner: they start at 0, so
        PFSP draws it as a new opponent); from memory: :meth:`add_member`."""
        from orchestration.snapshots import load_snapshot

        snapshot = load_snapshot(path)
        member = Member(self._unique(snapshot.policy_id if name is None else name), snapshot.weights(),
                        rating=INITIAL if snapshot.rating is None else snapshot.rating)
        self.pool.append(member)
        return member

    def _unique(self, name: str) -> str:
        """``name``, or ``name@2``, ``name@3``... where the pool holds it already (each member's statistics are
        its own: two of one name would be told apart nowhere)."""
        taken, unique, k = {m.name for m in self.pool}, name, 1
        while unique in taken:
            k += 1
            unique = f"{name}@{k}"
        return unique

    def _draw(self) -> Member:
        if self.sampling == "latest":
            return self.pool[-1]
        power = 0.0 if self.sampling == "uniform" else self.pfsp_power
        weights = torch.tensor([(1.0 - m.win_rate) ** power + 1e-3 for m in self.pool])
        return self.pool[int(torch.multinomial(weights, 1, generator=self.generator))]

    def train(self) -> dict[str, float]:
        """One sub-trainer iteration against a drawn opponent, then the pool's bookkeeping."""
        self.current = self._draw()
        self.trainer.set_weights(self.opponent, self.current.weights)  # in every actor before its next fragment
        metrics = self.trainer.train()
        new = self.trainer.last_episodes.get(f"return/{self.learner}", [])
        self.current.games += len(new)
        self.current.score += float(sum(new))
        won = float(score_from_return(torch.tensor(new, dtype=torch.float64)).mean()) if new else float("nan")
        if new:  # learner = player 0, the member = player 1; the iteration's games as one match (MATCH_K)
            ratings = elo_update(torch.tensor([self.rating, self.current.rating], dtype=torch.float64),
                                 torch.tensor([0]), torch.tensor([1]), torch.tensor([won], dtype=torch.float64),
                                 k=MATCH_K)
            self.rating, self.current.rating = float(ratings[0]), float(ratings[1])
        if self.trainer.iteration % self.snapshot_every == 0:
            version, weights = self.trainer.learners[self.learner].weights()
            self.pool.append(Member(f"{self.learner}@{version}", weights.clone(), rating=self.rating))
        metrics.update(league_size=len(self.pool), league_opponent=self.pool.index(self.current),
                       league_win_rate=won, league_games=len(new), league_elo=self.rating,
                       league_opponent_win_rate=self.current.win_rate, league_opponent_elo=self.current.rating)
        return metrics

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, json)``: the pool (each member's weights ``pool/<index>/<key>``, name, games, score,
        rating), the learner's rating, the current opponent and the draws' generator. The sub-trainer is saved
        on its own (:func:`orchestration.run_state.trainer_state`)."""
        tensors = {f"pool/{i}/{'/'.join(k) if isinstance(k, tuple) else k}": v
                   for i, m in enumerate(self.pool) for k, v in m.weights.items(True, True)}
        tensors["rng"] = self.generator.get_state()
        members = [{"name": m.name, "games": m.games, "score": m.score, "rating": m.rating} for m in self.pool]
        return tensors, {"members": members, "rating": self.rating, "current": self.pool.index(self.current)}

    def load_state_(self, tensors: Mapping[str, torch.Tensor], state: Mapping[str, Any]) -> None:
        """Restores :meth:`state` into a league over a trainer of the same policies. Raises ValueError naming
        the member whose weights do not fit the opponent slot."""
        template, pool = self.pool[0].weights, []
        for i, m in enumerate(state["members"]):
            weights = template.clone()
            for key, value in template.items(True, True):
                name = f"pool/{i}/{'/'.join(key) if isinstance(key, tuple) else key}"
                if name not in tensors or tensors[name].shape != value.shape:
                    got = tuple(tensors[name].shape) if name in tensors else "missing"
                    raise ValueError(f"league member {m['name']!r}: its weights do not fit the opponent slot "
                                     f"{self.opponent!r} ({name} is {got}, the slot's is {tuple(value.shape)})")
                weights.set(key, tensors[name].clone())
            pool.append(Member(str(m["name"]), weights, int(m["games"]), float(m["score"]), float(m["rating"])))
        self.pool, self.rating = pool, float(state["rating"])
        self.current = self.pool[int(state["current"])]
        self.generator.set_state(tensors["rng"])


__all__ = ["LeagueTrainer", "Member", "SAMPLINGS"]
