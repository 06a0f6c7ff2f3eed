"""Tensors from a tree: torchrl specs, zeros and random samples in the step layout.

A *step* of a tree with batch ``B`` (e.g. ``(env,)`` or ``(env, time)``) is::

    td[group]["observation"...]   [*B, capacity, *leaf.shape]
    td[group]["action"...]        [*B, capacity, *leaf.shape]
    td[group]["mask"]             [*B, capacity] bool
    td[group]["action_mask"]      [*B, capacity, n] bool     (a single discrete action leaf)
    td[group]["action_mask", ...] [*B, capacity, ...] bool   (a structured action: a mask tree keyed like the
                                                              action, plus "@present" per non-atomic element;
                                                              :mod:`core.specs.structure`)
    td["shared"...]               [*B, *leaf.shape]           (shared observations, when the tree has any)

torchrl is imported by the functions that build or read its specs, not by this module: ``torchrl.data`` also
imports ``torch._dynamo`` (through its replay buffers), a cost a rollout worker that never converts a tree
need not pay (``benchmarks/worker_start.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from tensordict import TensorDict

if TYPE_CHECKING:
    from torchrl.data import Composite, TensorSpec

from core.layout import ACTION, ACTION_MASK, MASK, OBSERVATION, SHARED

from .grouping import groups, shared_observations
from .nodes import AgentNode, ArrayPopulation, DictNode, DictPopulation, Leaf, Node, Tree, TreeError
from .structure import action_mask_shapes


def _bound_tensor(value, shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(value, tuple):
        return torch.tensor(value, dtype=torch.float64).reshape(shape)
    return torch.full(shape, value, dtype=torch.float64)


def leaf_bounds(leaf: Leaf) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive ``(low, high)`` of every element of ``leaf`` as float64 tensors of ``leaf.shape``."""
    if leaf.kind == "box":
        low, high = _bound_tensor(leaf.low, leaf.shape), _bound_tensor(leaf.high, leaf.shape)
        if leaf.dtype.is_floating_point:  # the bounds the data can actually hold, at the leaf's precision
            low, high = low.to(leaf.dtype).double(), high.to(leaf.dtype).double()
        return low, high
    if leaf.kind == "discrete":
        return torch.tensor(float(leaf.start)), torch.tensor(float(leaf.start + leaf.n - 1))
    if leaf.kind == "multi_discrete":
        return torch.zeros(leaf.shape, dtype=torch.float64), torch.tensor(leaf.nvec, dtype=torch.float64) - 1
    return torch.zeros(leaf.shape, dtype=torch.float64), torch.ones(leaf.shape, dtype=torch.float64)


def leaf_to_torchrl(leaf: Leaf) -> TensorSpec:
    """The torchrl spec of one leaf (Bounded/Unbounded, Categorical, MultiCategorical, Binary)."""
    from torchrl.data import Binary, Bounded, Categorical, MultiCategorical, Unbounded

    if leaf.kind == "box":
        low, high = leaf_bounds(leaf)
        if bool(torch.isinf(low).all() and torch.isinf(high).all()):
            return Unbounded(shape=leaf.shape, dtype=leaf.dtype)
        return Bounded(low=low.to(leaf.dtype), high=high.to(leaf.dtype), shape=leaf.shape, dtype=leaf.dtype)
    if leaf.kind == "discrete":
        if leaf.start != 0:
            low, high = leaf_bounds(leaf)
            return Bounded(low=low.to(leaf.dtype), high=high.to(leaf.dtype), shape=(), dtype=leaf.dtype)
        return Categorical(leaf.n, shape=(), dtype=leaf.dtype)
    if leaf.kind == "multi_discrete":
        return MultiCategorical(nvec=list(leaf.nvec), dtype=leaf.dtype)
    return Binary(n=leaf.n, dtype=leaf.dtype)


def leaf_from_torchrl(spec: TensorSpec, *, eval_only: bool = False) -> Leaf:
    """The leaf of a torchrl leaf spec (inverse of :func:`leaf_to_torchrl`)."""
    from torchrl.data import Binary, Bounded, Categorical, MultiCategorical, Unbounded

    shape = tuple(spec.shape)
    # Binary and MultiCategorical subclass Categorical in torchrl: test the subclasses first.
    if isinstance(spec, MultiCategorical):
        return Leaf.multi_discrete(spec.nvec.flatten().tolist(), dtype=spec.dtype, eval_only=eval_only)
    if isinstance(spec, Binary):
        return Leaf.binary(shape[-1], dtype=spec.dtype, eval_only=eval_only)
    if isinstance(spec, Categorical):
        return Leaf.discrete(spec.space.n, dtype=spec.dtype, eval_only=eval_only)
    if isinstance(spec, Unbounded):
        return Leaf.box(shape, dtype=spec.dtype, eval_only=eval_only)
    if isinstance(spec, Bounded):
        low, high = spec.space.low.double(), spec.space.high.double()
        if shape == () and not spec.dtype.is_floating_point:
            return Leaf("discrete", (), spec.dtype, n=int(high - low) + 1, start=int(low), eval_only=eval_only)
        return Leaf.box(shape, low=low, high=high, dtype=spec.dtype, eval_only=eval_only)
    raise TypeError(f"no Shoal leaf for torchrl spec {type(spec).__name__} of shape {shape}")


def node_to_torchrl(node: Node, batch: tuple[int, ...] = ()) -> TensorSpec:
    """A torchrl spec of ``node`` with leading ``batch`` dims (a :class:`Composite` for dict nodes)."""
    from torchrl.data import Composite

    if isinstance(node, Leaf):
        spec = leaf_to_torchrl(node)
        return spec.expand(*batch, *spec.shape) if batch else spec
    return Composite({k: node_to_torchrl(c, batch) for k, c in node.children.items()}, shape=batch)


def _action_mask_size(node: Node) -> int | None:
    return node.n if isinstance(node, Leaf) and node.kind == "discrete" else None


def to_composite(tree: Tree, batch: Iterable[int] = ()) -> Composite:
    """The step spec of ``tree`` as a torchrl :class:`Composite` with leading ``batch`` dims (module doc)."""
    from torchrl.data import Binary, Composite

    batch = tuple(batch)
    entries: dict[str, TensorSpec] = {}
    for name, g in groups(tree).items():
        gb = (*batch, g.capacity)
        group = {OBSERVATION: node_to_torchrl(g.agent.observation, gb),
                 ACTION: node_to_torchrl(g.agent.action, gb),
                 MASK: Binary(n=g.capacity, shape=gb, dtype=torch.bool)}
        n = _action_mask_size(g.agent.action)
        if n is not None:
            group[ACTION_MASK] = Binary(n=n, shape=(*gb, n), dtype=torch.bool)
        elif (tree_mask := _mask_tree_spec(g.agent.action, gb)) is not None:
            group[ACTION_MASK] = tree_mask
        entries[name] = Composite(group, shape=gb)
    shared = shared_observations(tree)
    if shared:
        entries[SHARED] = _shared_spec(shared, batch)
    return Composite(entries, shape=batch)


def _mask_tree_spec(action: Node, gb: tuple[int, ...]) -> Composite | None:
    """The spec of a structured action's mask tree (:func:`core.specs.structure.action_mask_shapes`)."""
    from torchrl.data import Binary, Composite

    shapes = action_mask_shapes(action)
    if shapes is None:
        return None
    out = Composite(shape=gb)
    for path, shape in shapes.items():
        full = (*gb, *shape)
        out[path] = Binary(n=full[-1], shape=full, dtype=torch.bool)
    return out


def _mask_tree(action: Node, gb: tuple[int, ...]) -> TensorDict | None:
    """All-True (everything legal, every element present) mask tree of a structured action, or None."""
    shapes = action_mask_shapes(action)
    if shapes is None:
        return None
    out = TensorDict(batch_size=gb)
    for path, shape in shapes.items():
        out.set(path, torch.ones(*gb, *shape, dtype=torch.bool))
    return out


def _shared_spec(shared: dict[tuple[str, ...], Node], batch: tuple[int, ...]) -> TensorSpec:
    from torchrl.data import Composite

    if () in shared and (len(shared) > 1 and isinstance(shared[()], Leaf)):
        raise TreeError("shared_observation", "a leaf shared observation at the root cannot sit beside nested ones")
    root = node_to_torchrl(shared[()], batch) if () in shared else Composite(shape=batch)
    for path, node in shared.items():
        if path:
            root[path] = node_to_torchrl(node, batch)
    return root


def _node_tensors(node: Node, batch: tuple[int, ...], fill, generator) -> torch.Tensor | dict:
    if isinstance(node, Leaf):
        return fill(node, batch, generator)
    return {k: _node_tensors(c, batch, fill, generator) for k, c in node.children.items()}


def _zeros_leaf(leaf: Leaf, batch, generator) -> torch.Tensor:
    low, high = leaf_bounds(leaf)
    # Zero when the bounds admit it, else the lower bound (a Discrete(3, start=1) has no 0).
    value = torch.zeros(leaf.shape, dtype=torch.float64).clamp(low, high)
    return value.to(leaf.dtype).expand(*batch, *leaf.shape).clone()


def _rand_leaf(leaf: Leaf, batch, generator) -> torch.Tensor:
    shape = (*batch, *leaf.shape)
    low, high = leaf_bounds(leaf)
    if leaf.kind == "box" and leaf.dtype.is_floating_point:
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        normal = torch.randn(shape, generator=generator, dtype=torch.float64)
        finite = torch.isfinite(low) & torch.isfinite(high)
        sample = torch.where(finite, low + u * (high - low), normal)
        sample = torch.where(torch.isfinite(low) & ~torch.isfinite(high), low + normal.abs(), sample)
        sample = torch.where(~torch.isfinite(low) & torch.isfinite(high), high - normal.abs(), sample)
        return sample.to(leaf.dtype)
    if leaf.kind == "box":  # integer box, e.g. uint8 images
        info = torch.iinfo(leaf.dtype) if leaf.dtype != torch.bool else None
        lo = low.clamp(min=info.min if info else 0).expand(shape)
        hi = high.clamp(max=info.max if info else 1).expand(shape)
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        return (lo + torch.floor(u * (hi - lo + 1))).clamp(lo, hi).to(leaf.dtype)
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    return (low + torch.floor(u * (high - low + 1))).clamp(low, high).to(leaf.dtype)


def _fill(tree: Tree, batch: Iterable[int], fill, generator, present: bool) -> TensorDict:
    batch = tuple(batch)
    out = TensorDict(batch_size=batch)
    for name, g in groups(tree).items():
        gb = (*batch, g.capacity)
        group = TensorDict(batch_size=gb)
        group.set(OBSERVATION, _node_tensors(g.agent.observation, gb, fill, generator))
        group.set(ACTION, _node_tensors(g.agent.action, gb, fill, generator))
        group.set(MASK, torch.full(gb, present, dtype=torch.bool))
        n = _action_mask_size(g.agent.action)
        if n is not None:
            group.set(ACTION_MASK, torch.ones(*gb, n, dtype=torch.bool))
        elif (tree_mask := _mask_tree(g.agent.action, gb)) is not None:
            group.set(ACTION_MASK, tree_mask)
        out.set(name, group)
    for path, node in shared_observations(tree).items():
        out.set((SHARED, *path), _node_tensors(node, batch, fill, generator))
    return out


def zeros(tree: Tree, batch: Iterable[int] = ()) -> TensorDict:
    """A step of zeros (clamped into the bounds) shaped like ``tree`` with leading ``batch`` dims.

    Masks are False (no agent present): the state of an env before any agent joined.
    """
    return _fill(tree, batch, _zeros_leaf, None, present=False)


def rand(tree: Tree, batch: Iterable[int] = (), generator: torch.Generator | None = None) -> TensorDict:
    """A random step inside the bounds of every leaf, all agents present, legal-everything action masks.

    Unbounded box elements are drawn from a standard normal (shifted to the finite side when one bound is).
    """
    return _fill(tree, batch, _rand_leaf, generator, present=True)


def _node_from_spec(spec: TensorSpec, batch_ndim: int) -> Node:
    from torchrl.data import Composite

    if isinstance(spec, Composite):
        return DictNode({k: _node_from_spec(spec[k], batch_ndim) for k in spec.keys()})
    return leaf_from_torchrl(spec[(0,) * batch_ndim] if batch_ndim else spec)


def from_composite(spec: Composite) -> Tree:
    """Rebuilds the structure of a tree from :func:`to_composite`'s output.

    A torchrl spec carries no Shoal metadata, so what comes back is the structure only: every group becomes
    an :class:`ArrayPopulation` member of a general-sum :class:`DictPopulation`, with no tags. Use
    :mod:`core.specs.serialize` (JSON) for a lossless round trip.
    """
    batch_ndim = len(spec.shape)
    members = {}
    shared = None
    for name in spec.keys():
        if name == SHARED:
            shared = _node_from_spec(spec[SHARED], batch_ndim)
            continue
        group = spec[name]
        agent = AgentNode(observation=_node_from_spec(group[OBSERVATION], batch_ndim + 1),
                          action=_node_from_spec(group[ACTION], batch_ndim + 1))
        members[name] = ArrayPopulation(template=agent, capacity=int(group.shape[-1]))
    if not members:
        raise TreeError("", "the composite holds no group")
    return DictPopulation(members=members, payoff="general", shared_observation=shared)


def capacity_of(tree: Tree) -> int:
    """Total number of agent slots across all groups."""
    return sum(g.capacity for g in groups(tree).values())


__all__ = [
    "capacity_of", "from_composite", "leaf_bounds", "leaf_from_torchrl", "leaf_to_torchrl", "node_to_torchrl",
    "rand", "to_composite", "zeros",
]
