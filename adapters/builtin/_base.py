"""What every built-in env shares: the :class:`adapters.protocol.BatchedEnv` properties and the seeding rule."""

from __future__ import annotations

from typing import Any

import torch

from core.specs import Tree


class BuiltinEnv:
    """Base of the built-in envs: ``tree``, ``num_envs`` (from ``config.num_envs``), no fault ``counters``, and
    :meth:`_seed_`, the rule of ``reset(seed)``: a seed re-seeds the batch's generator, None continues its stream
    (seeded from the OS the first time)."""

    config: Any
    _tree: Tree
    _generator: torch.Generator
    _seeded: bool = False

    @property
    def tree(self) -> Tree:
        return self._tree

    @property
    def num_envs(self) -> int:
        return self.config.num_envs

    @property
    def counters(self) -> dict[str, int]:
        return {}

    def _seed_(self, seed: int | None) -> None:
        if seed is not None:
            self._generator.manual_seed(seed)
        elif not self._seeded:
            self._generator.seed()
        self._seeded = True


__all__ = ["BuiltinEnv"]
