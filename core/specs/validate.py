"""Checking data against a tree: errors name the path, the agent, the env and what was expected.

Only present agents (``mask`` True) are checked for bounds and finiteness: padded slots hold whatever the
adapter left there. Shapes and dtypes are checked for every slot.
"""

from __future__ import annotations

from typing import Iterable

import torch
from tensordict import TensorDictBase

from core.layout import MASK, OBSERVATION, SHARED

from .grouping import GroupSpec, groups, shared_observations
from .nodes import Leaf, Node, Tree, iter_leaves
from .tensors import leaf_bounds


class SpecViolation(ValueError):
    """Data that does not match its tree.

    Attributes:
        key: the nested key at fault, e.g. ``("adversary", "observation", "pos")``.
        agent: name of the agent at fault, or None for shared data / whole-tensor problems.
        env: index of the first env at fault, or None.
    """

    def __init__(self, key: tuple[str, ...], message: str, *, agent: str | None = None, env: int | None = None):
        where = "/".join(key)
        who = f" agent {agent!r}" if agent is not None else ""
        at = f" env {env}" if env is not None else ""
        super().__init__(f"{where}{who}{at}: {message}")
        self.key, self.agent, self.env = key, agent, env


def _first_bad(bad: torch.Tensor, batch_ndim: int, agent_dim: bool) -> tuple[int | None, int | None]:
    """(env index, agent slot) of the first True of ``bad`` reduced to ``[*batch, (agent)]``."""
    keep = batch_ndim + (1 if agent_dim else 0)
    while bad.ndim > keep:
        bad = bad.any(-1)
    idx = bad.nonzero()
    if idx.numel() == 0:
        return None, None
    first = idx[0].tolist()
    return (first[0] if batch_ndim else None), (first[-1] if agent_dim else None)


def _check_leaf(value, leaf: Leaf, key, batch: tuple[int, ...], present: torch.Tensor | None,
                group: GroupSpec | None, check_values: bool) -> None:
    agent_dim = group is not None
    expected = (*batch, *((group.capacity,) if agent_dim else ()), *leaf.shape)
    if not isinstance(value, torch.Tensor):
        raise SpecViolation(key, f"expected a tensor of shape {expected}, got {type(value).__name__}")
    if tuple(value.shape) != expected:
        raise SpecViolation(key, f"expected shape {expected}, got {tuple(value.shape)}")
    if value.dtype != leaf.dtype:
        raise SpecViolation(key, f"expected dtype {leaf.dtype}, got {value.dtype}")
    if not check_values:
        return
    low, high = leaf_bounds(leaf)
    v = value.double()
    bad = ~torch.isfinite(v) if v.is_floating_point() else torch.zeros_like(v, dtype=torch.bool)
    what = "NaN or Inf"
    out_of_bounds = (v < low) | (v > high)
    if not bad.any() and out_of_bounds.any():
        bad, what = out_of_bounds, f"outside bounds [{low.min().item()}, {high.max().item()}]"
    if present is not None:
        bad = bad & present.reshape(*present.shape, *([1] * len(leaf.shape)))
    if bad.any():
        env, slot = _first_bad(bad, len(batch), agent_dim)
        agent = group.agent_names[slot] if agent_dim else None
        sample = v[bad][0].item()
        raise SpecViolation(key, f"value {sample} is {what}", agent=agent, env=env)


def _check_node(td: TensorDictBase, node: Node, prefix: tuple[str, ...], batch, present, group,
                check_values: bool) -> None:
    for path, leaf in iter_leaves(node):
        key = (*prefix, *path)
        if key not in td.keys(include_nested=True, leaves_only=False):
            raise SpecViolation(key, "missing")
        _check_leaf(td.get(key), leaf, key, batch, present, group, check_values)


def validate(td: TensorDictBase, tree: Tree, *, batch: Iterable[int] | None = None,
             parts: Iterable[str] = (OBSERVATION,), check_values: bool = True) -> None:
    """Raises :class:`SpecViolation` unless ``td`` holds ``parts`` of every group of ``tree``.

    Args:
        td: a step or rollout in the layout of :mod:`core.specs.tensors` (e.g. batch ``[env]``).
        tree: the tree the data should match.
        batch: the leading batch dims; defaults to ``td.batch_size``.
        parts: which agent parts to check: ``"observation"`` and/or ``"action"``; shared observations are
            checked whenever the tree has them and ``"observation"`` is in ``parts``.
        check_values: also check bounds and NaN/Inf of present agents (shape and dtype always).
    """
    batch = tuple(td.batch_size if batch is None else batch)
    parts = (parts,) if isinstance(parts, str) else tuple(parts)  # "action" is one part, not six letters
    for name, g in groups(tree).items():
        if name not in td.keys():
            raise SpecViolation((name,), "group missing")
        mask_key = (name, MASK)
        present = td.get(mask_key) if mask_key in td.keys(include_nested=True) else None
        if present is not None and (tuple(present.shape) != (*batch, g.capacity) or present.dtype != torch.bool):
            raise SpecViolation(mask_key, f"expected bool of shape {(*batch, g.capacity)}, got "
                                          f"{present.dtype} {tuple(present.shape)}")
        for part in parts:
            node = g.agent.observation if part == OBSERVATION else g.agent.action
            _check_node(td, node, (name, part), batch, present, g, check_values)
    if OBSERVATION in parts:
        for path, node in shared_observations(tree).items():
            _check_node(td, node, (SHARED, *path), batch, None, None, check_values)


__all__ = ["SpecViolation", "validate"]
