"""Curricula (seed 002): a partial order over env ids, unlocked stage by stage as a metric passes a threshold.

An edge ``(a, b)`` reads "``a`` comes before ``b``". Envs without predecessors (the roots) start unlocked.
:meth:`Curriculum.promote` is the one rule, a pure function of the state and the metrics reported per env:

1. an *unlocked* env whose ``metric`` is ``>= threshold`` becomes *mastered* (metrics of locked envs, say from
   evaluation, never count; NaN never passes);
2. a locked env is unlocked when all (``require="all"``) or any (``require="any"``) of its predecessors are
   mastered, and never before.

One call applies rule 1 and then rule 2 once, so a promotion needs a metric reported after its predecessor
was unlocked: an env unlocked by a call is mastered at the earliest by the next. Both sets only grow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import torch

from .ids import (CollectionError, check_finite, check_id, check_ids, check_known, check_metric_ids, draw_uniform,
                  hint, missing_metric)

REQUIRES: tuple[str, ...] = ("all", "any")


@dataclass(frozen=True, kw_only=True, slots=True)
class CurriculumState:
    """Where a curriculum stands; a value, replaced (never changed) by :meth:`Curriculum.promote`."""

    unlocked: frozenset[str]
    """Env ids training may draw; only grows."""
    mastered: frozenset[str] = frozenset()
    """Unlocked env ids whose metric has met the threshold at least once; only grows."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "unlocked", frozenset(self.unlocked))
        object.__setattr__(self, "mastered", frozenset(self.mastered))


def find_cycle(nodes: Sequence[str], edges: Sequence[tuple[str, str]]) -> tuple[str, ...] | None:
    """A cycle of the directed graph as ``(a, b, ..., a)``, or None when it is acyclic (depth-first search)."""
    successors: dict[str, list[str]] = {v: [] for v in nodes}
    for a, b in edges:
        successors[a].append(b)
    colour = dict.fromkeys(nodes, 0)  # 0 unseen, 1 on the current path, 2 done
    for root in nodes:
        if colour[root]:
            continue
        path, stack = [root], [iter(successors[root])]
        colour[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = 2
                stack.pop()
            elif colour[nxt] == 1:
                return tuple(path[path.index(nxt):]) + (nxt,)
            elif colour[nxt] == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append(iter(successors[nxt]))
    return None


def _check_edges(edges: object, stages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    if isinstance(edges, str) or not isinstance(edges, Sequence):
        raise CollectionError("curriculum.edges", f"expected a list of (before, after) pairs, got {edges!r}")
    out: list[tuple[str, str]] = []
    for k, edge in enumerate(edges):
        where = f"curriculum.edges[{k}]"
        if isinstance(edge, str) or not isinstance(edge, Sequence) or len(edge) != 2:
            raise CollectionError(where, f"expected a (before, after) pair of env ids, got {edge!r}")
        pair = (check_known(edge[0], stages, where), check_known(edge[1], stages, where))
        if pair in out:
            raise CollectionError(where, f"edge {pair[0]!r} -> {pair[1]!r} is listed twice")
        out.append(pair)
    cycle = find_cycle(stages, out)
    if cycle is not None:
        raise CollectionError("curriculum.edges", f"the order has a cycle {' -> '.join(cycle)}; "
                                                  "a curriculum must be acyclic")
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class Curriculum:
    """A partial order over env ids with promotion on a metric threshold (see the module docstring)."""

    stages: tuple[str, ...]
    """Every env id of the curriculum, no repeats; training draws order and ties follow this order."""
    edges: tuple[tuple[str, str], ...] = ()
    """``(before, after)`` pairs: ``after`` unlocks once ``before`` is mastered; must be acyclic."""
    metric: str
    """Name of the per-env metric that promotes (e.g. ``"mean_return"``); higher is better."""
    threshold: float
    """An unlocked env is mastered when its metric is ``>= threshold``."""
    require: Literal["all", "any"] = "all"
    """Unlock an env when all of its predecessors are mastered, or when any one is."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", check_ids(self.stages, "curriculum.stages"))
        object.__setattr__(self, "edges", _check_edges(self.edges, self.stages))
        check_id(self.metric, "curriculum.metric", what="metric name")
        object.__setattr__(self, "threshold", check_finite(self.threshold, "curriculum.threshold"))
        if self.require not in REQUIRES:
            raise CollectionError("curriculum.require", f"unknown value {self.require!r}{hint(self.require, REQUIRES)}")

    @property
    def ids(self) -> tuple[str, ...]:
        """Every env id, in stage order."""
        return self.stages

    def predecessors(self, env_id: str) -> tuple[str, ...]:
        """The envs directly before ``env_id``, in edge order."""
        check_known(env_id, self.stages, "env_id")
        return tuple(a for a, b in self.edges if b == env_id)

    def successors(self, env_id: str) -> tuple[str, ...]:
        """The envs directly after ``env_id``, in edge order."""
        check_known(env_id, self.stages, "env_id")
        return tuple(b for a, b in self.edges if a == env_id)

    def initial_state(self) -> CurriculumState:
        """The roots (envs without predecessors) unlocked, nothing mastered."""
        after = {b for _, b in self.edges}
        return CurriculumState(unlocked=frozenset(s for s in self.stages if s not in after))

    def training_ids(self, state: CurriculumState) -> tuple[str, ...]:
        """The unlocked envs, in stage order."""
        self._check_state(state)
        return tuple(s for s in self.stages if s in state.unlocked)

    def evaluation_ids(self) -> tuple[str, ...]:
        """Every stage (progress is measured on locked envs too; their metrics never promote)."""
        return self.stages

    def draw(self, state: CurriculumState, n: int, generator: torch.Generator) -> tuple[str, ...]:
        """``n`` env ids drawn uniformly among the unlocked ones; deterministic given ``generator``."""
        return draw_uniform(self.training_ids(state), n, generator)

    def promote(self, state: CurriculumState, metrics_by_env: Mapping[str, Mapping[str, Any]]) -> CurriculumState:
        """The state after one report of ``{env_id: {metric_name: value}}`` (a new state; rules in the module doc).

        Raises:
            CollectionError: an unknown env id, or an env whose metrics lack ``metric`` (nearest names suggested).
        """
        self._check_state(state)
        passed = {env_id for env_id, value in self._metric_values(metrics_by_env).items()
                  if env_id in state.unlocked and value >= self.threshold}
        mastered = state.mastered | passed
        quantifier = all if self.require == "all" else any
        unlocked = {s for s in self.stages if s not in state.unlocked
                    and quantifier(p in mastered for p in self.predecessors(s))}
        return CurriculumState(unlocked=state.unlocked | unlocked, mastered=mastered)

    def update(self, state: CurriculumState, metrics_by_env: Mapping[str, Mapping[str, Any]]) -> CurriculumState:
        """Same as :meth:`promote` (the name every structure shares)."""
        return self.promote(state, metrics_by_env)

    def _metric_values(self, metrics_by_env: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
        check_metric_ids(metrics_by_env, self.stages, "metrics_by_env")
        out: dict[str, float] = {}
        for env_id, metrics in metrics_by_env.items():
            if not isinstance(metrics, Mapping) or self.metric not in metrics:
                raise missing_metric(env_id, self.metric, metrics, "curriculum.metric")
            value = float(metrics[self.metric])
            out[env_id] = -math.inf if math.isnan(value) else value
        return out

    def _check_state(self, state: CurriculumState) -> None:
        if not isinstance(state, CurriculumState):
            raise CollectionError("state", f"expected a CurriculumState, got {type(state).__name__}")
        for env_id in sorted(state.unlocked):
            check_known(env_id, self.stages, "state.unlocked")
        for env_id in sorted(state.mastered - state.unlocked):
            raise CollectionError("state.mastered", f"env id {env_id!r} is mastered but not unlocked")


__all__ = ["REQUIRES", "Curriculum", "CurriculumState", "find_cycle"]
