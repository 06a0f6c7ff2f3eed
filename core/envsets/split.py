"""Train/test split (seed 002): training draws only train envs, evaluation runs only test envs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .ids import CollectionError, check_ids, check_metric_ids, draw_uniform


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    """Two disjoint, non-empty sets of env ids: one to train on, one to evaluate on.

    Stateless: its state is ``None``. ``draw`` picks train envs uniformly.
    """

    train: tuple[str, ...]
    """Env ids trained on, drawn uniformly at the start of each episode; non-empty, no repeats."""
    test: tuple[str, ...]
    """Env ids evaluated on and never trained on; non-empty, no repeats, disjoint from ``train``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "train", check_ids(self.train, "split.train"))
        object.__setattr__(self, "test", check_ids(self.test, "split.test"))
        train = set(self.train)
        for k, env_id in enumerate(self.test):
            if env_id in train:
                raise CollectionError(f"split.test[{k}]", f"env id {env_id!r} is also in split.train; "
                                                          "train and test must be disjoint")

    @property
    def ids(self) -> tuple[str, ...]:
        """Every env id of the split, train first."""
        return self.train + self.test

    def initial_state(self) -> None:
        """A split has no state."""
        return None

    def training_ids(self, state: None = None) -> tuple[str, ...]:
        """The train envs."""
        return self.train

    def evaluation_ids(self) -> tuple[str, ...]:
        """The test envs."""
        return self.test

    def draw(self, state: None, n: int, generator: torch.Generator) -> tuple[str, ...]:
        """``n`` train env ids, uniformly with replacement; deterministic given ``generator``."""
        return draw_uniform(self.train, n, generator)

    def update(self, state: None, metrics_by_env: Mapping[str, Mapping[str, Any]]) -> None:
        """Checks the env ids of ``metrics_by_env``; a split has no state to move."""
        check_metric_ids(metrics_by_env, self.ids, "metrics_by_env")
        return None


__all__ = ["Split"]
