"""Prior distributions (seed 002): env parameters drawn from a declared distribution at the start of each episode.

``PriorDistribution(id="pendulum", params={"gravity": Uniform(low=8.0, high=12.0),
"length": Normal(mean=1.0, std=0.1, clip=(0.5, 1.5)), "mass": Choice(values=(1, 2), probs=(0.7, 0.3))})``:
``sample(n, generator)`` gives ``{"gravity": [n], "length": [n], "mass": [n]}``, float64 (int64 for a
:class:`Choice` of ints), one entry per episode. Parameters are drawn in sorted name order, so the draws do
not depend on the order of the declaration.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Union

import torch

from .ids import CollectionError, check_count, check_finite, check_id, check_metric_ids, hint


@dataclass(frozen=True, kw_only=True, slots=True)
class Uniform:
    """Uniform on ``[low, high)``."""

    low: float
    """Lower bound (inclusive), finite."""
    high: float
    """Upper bound (exclusive), finite, > ``low``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "low", check_finite(self.low, "uniform.low"))
        object.__setattr__(self, "high", check_finite(self.high, "uniform.high"))
        if self.high <= self.low:
            raise CollectionError("uniform.high", f"must be > low, got low={self.low}, high={self.high}")

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n]`` float64 draws."""
        u = torch.rand(check_count(n), generator=generator, dtype=torch.float64)
        return self.low + (self.high - self.low) * u


@dataclass(frozen=True, kw_only=True, slots=True)
class Normal:
    """Gaussian ``N(mean, std^2)``, optionally clipped: draws outside ``clip`` are moved to the nearer bound."""

    mean: float
    """Mean, finite."""
    std: float
    """Standard deviation, finite, > 0."""
    clip: tuple[float, float] | None = None
    """``(low, high)`` bounds the draws are clamped to (mass beyond a bound sits on it), or None."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", check_finite(self.mean, "normal.mean"))
        std = check_finite(self.std, "normal.std")
        if std <= 0:
            raise CollectionError("normal.std", f"must be > 0, got {self.std!r}")
        object.__setattr__(self, "std", std)
        if self.clip is not None:
            if isinstance(self.clip, str) or not hasattr(self.clip, "__len__") or len(self.clip) != 2:
                raise CollectionError("normal.clip", f"expected (low, high) or None, got {self.clip!r}")
            low, high = check_finite(self.clip[0], "normal.clip[0]"), check_finite(self.clip[1], "normal.clip[1]")
            if high <= low:
                raise CollectionError("normal.clip", f"high must be > low, got {self.clip!r}")
            object.__setattr__(self, "clip", (low, high))

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n]`` float64 draws."""
        x = self.mean + self.std * torch.randn(check_count(n), generator=generator, dtype=torch.float64)
        return x if self.clip is None else x.clamp(*self.clip)


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One of ``values``, with probabilities ``probs`` (uniform when None)."""

    values: tuple[int | float, ...]
    """The possible values: numbers (not bools), distinct, at least one; all ints give an int64 tensor."""
    probs: tuple[float, ...] | None = None
    """One probability per value (>= 0, summing to 1 within 1e-6), or None for uniform."""

    def __post_init__(self) -> None:
        values = _sequence(self.values, "choice.values")
        if not values:
            raise CollectionError("choice.values", "needs at least one value")
        for k, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CollectionError(f"choice.values[{k}]", f"expected a number, got {v!r}")
            check_finite(v, f"choice.values[{k}]")
            if v in values[:k]:
                raise CollectionError(f"choice.values[{k}]", f"value {v!r} is listed twice")
        object.__setattr__(self, "values", values)
        if self.probs is not None:
            probs = tuple(check_finite(p, f"choice.probs[{k}]")
                          for k, p in enumerate(_sequence(self.probs, "choice.probs")))
            if len(probs) != len(values):
                raise CollectionError("choice.probs", f"has {len(probs)} entries for {len(values)} values")
            if any(p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
                raise CollectionError("choice.probs", f"must be >= 0 and sum to 1, got {probs}")
            object.__setattr__(self, "probs", probs)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n]`` draws: int64 when every value is an int, else float64."""
        n = check_count(n)
        dtype = torch.int64 if all(isinstance(v, int) for v in self.values) else torch.float64
        values = torch.tensor(self.values, dtype=dtype)
        if n == 0:
            return values[:0]
        probs = torch.tensor(self.probs if self.probs is not None else [1.0] * len(self.values), dtype=torch.float64)
        return values[torch.multinomial(probs, n, replacement=True, generator=generator)]


Distribution = Union[Uniform, Normal, Choice]
DISTRIBUTIONS: tuple[type, ...] = (Uniform, Normal, Choice)


def _sequence(values: object, where: str) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise CollectionError(where, f"expected a list, got {values!r}")
    return tuple(values)


@dataclass(frozen=True, kw_only=True, slots=True)
class PriorDistribution:
    """One env whose parameters are drawn per episode; a collection structure over that single env id."""

    id: str
    """The env id whose constructor/reset receives the drawn parameters."""
    params: Mapping[str, Distribution]
    """Parameter name -> distribution; at least one. Names follow the env id rules."""

    def __post_init__(self) -> None:
        check_id(self.id, "prior.id")
        if not isinstance(self.params, Mapping) or not self.params:
            raise CollectionError("prior.params", f"expected a non-empty mapping name -> distribution, got "
                                                  f"{self.params!r}")
        for name, dist in self.params.items():
            check_id(name, f"prior.params[{name!r}]", what="parameter name")
            if not isinstance(dist, DISTRIBUTIONS):
                raise CollectionError(f"prior.params[{name!r}]", f"expected one of "
                                      f"{', '.join(d.__name__ for d in DISTRIBUTIONS)}, got {type(dist).__name__}")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def ids(self) -> tuple[str, ...]:
        """The one env id."""
        return (self.id,)

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """``{name: [n]}``: parameters for ``n`` episodes, in sorted name order; deterministic given ``generator``."""
        return {name: self.params[name].sample(n, generator) for name in sorted(self.params)}

    def param(self, name: str) -> Distribution:
        """The distribution of one parameter (an error names the nearest parameter)."""
        if name not in self.params:
            raise CollectionError("name", f"unknown parameter {name!r}{hint(name, self.params)}")
        return self.params[name]

    def initial_state(self) -> None:
        """A prior has no state."""
        return None

    def training_ids(self, state: None = None) -> tuple[str, ...]:
        """The one env."""
        return self.ids

    def evaluation_ids(self) -> tuple[str, ...]:
        """The one env."""
        return self.ids

    def draw(self, state: None, n: int, generator: torch.Generator) -> tuple[str, ...]:
        """The one env id ``n`` times (its parameters come from :meth:`sample`); draws no random numbers."""
        return self.ids * check_count(n)

    def update(self, state: None, metrics_by_env: Mapping[str, Mapping[str, Any]]) -> None:
        """Checks the env ids of ``metrics_by_env``; a prior has no state to move."""
        check_metric_ids(metrics_by_env, self.ids, "metrics_by_env")
        return None


__all__ = ["DISTRIBUTIONS", "Choice", "Distribution", "Normal", "PriorDistribution", "Uniform"]
