"""Adversarial sets (seed 002): train most on the envs where the learner does worst.

The state is the latest measured return per env id (``{env_id: float}``; an env never measured is absent or
NaN). Draw probabilities, for the ``K`` env ids ``i`` of the set, are

    r_hat_i = (r_i - min_j r_j) / (max_j r_j - min_j r_j)      (0 for every env when all returns are equal)
    p_i     = softmax_i(-r_hat_i / temperature)

with min/max over the measured envs. Returns are min-max normalised so ``temperature`` does not depend on the
scale of the reward: the best env is drawn ``exp(1 / temperature)`` times less often than the worst. An env
never measured gets ``r_hat = 0``, the highest weight (the same as the worst measured env).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .ids import CollectionError, check_count, check_finite, check_id, check_ids, check_metric_ids, missing_metric


@dataclass(frozen=True, kw_only=True, slots=True)
class AdversarialSet:
    """Env ids drawn by a softmax of their negative normalised return (see the module docstring)."""

    ids: tuple[str, ...]
    """Every env id of the set, trained and evaluated on; no repeats."""
    temperature: float = 1.0
    """Softmax temperature (> 0): small concentrates training on the worst env, large draws near uniformly."""
    metric: str = "mean_return"
    """The per-env metric :meth:`update` records as the env's return (higher is better)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", check_ids(self.ids, "adversarial.ids"))
        temperature = check_finite(self.temperature, "adversarial.temperature")
        if temperature <= 0:
            raise CollectionError("adversarial.temperature", f"must be > 0, got {self.temperature!r}")
        object.__setattr__(self, "temperature", temperature)
        check_id(self.metric, "adversarial.metric", what="metric name")

    def initial_state(self) -> dict[str, float]:
        """Nothing measured yet (every env drawn with the same probability)."""
        return {}

    def training_ids(self, state: Mapping[str, float] | None = None) -> tuple[str, ...]:
        """Every env of the set (:meth:`draw` weights them)."""
        return self.ids

    def evaluation_ids(self) -> tuple[str, ...]:
        """Every env of the set (the worst case is measured over all of them)."""
        return self.ids

    def probabilities(self, returns_by_env: Mapping[str, float]) -> torch.Tensor:
        """Draw probabilities ``[K]`` (float64, in ``ids`` order) given the latest return per env id.

        Raises:
            CollectionError: an unknown env id (nearest suggested) or an infinite return.
        """
        check_metric_ids(returns_by_env, self.ids, "returns_by_env")
        returns = torch.tensor([self._return(returns_by_env, env_id) for env_id in self.ids], dtype=torch.float64)
        measured = ~returns.isnan()
        normalised = torch.zeros_like(returns)
        if measured.any():
            low, high = returns[measured].min(), returns[measured].max()
            if high > low:
                normalised[measured] = (returns[measured] - low) / (high - low)
        return torch.softmax(-normalised / self.temperature, dim=0)

    def draw(self, returns_by_env: Mapping[str, float], n: int, generator: torch.Generator) -> tuple[str, ...]:
        """``n`` env ids drawn with replacement by :meth:`probabilities`; deterministic given ``generator``."""
        if check_count(n) == 0:
            return ()
        picks = torch.multinomial(self.probabilities(returns_by_env), n, replacement=True, generator=generator)
        return tuple(self.ids[k] for k in picks.tolist())

    def update(self, state: Mapping[str, float], metrics_by_env: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
        """A new state: ``state`` with each reported env's return replaced by its latest ``metric``."""
        check_metric_ids(state, self.ids, "state")
        check_metric_ids(metrics_by_env, self.ids, "metrics_by_env")
        out = dict(state)
        for env_id, metrics in metrics_by_env.items():
            if not isinstance(metrics, Mapping) or self.metric not in metrics:
                raise missing_metric(env_id, self.metric, metrics, "adversarial.metric")
            out[env_id] = float(metrics[self.metric])
        return out

    @staticmethod
    def _return(returns_by_env: Mapping[str, float], env_id: str) -> float:
        value = float(returns_by_env.get(env_id, math.nan))
        if math.isinf(value):
            raise CollectionError(f"returns_by_env[{env_id!r}]", f"return must be finite or NaN, got {value}")
        return value


__all__ = ["AdversarialSet"]
