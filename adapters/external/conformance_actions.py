"""Random legal actions of a tree's action nodes, as numpy arrays: how the conformance kit answers an ``act``.

Every element lies inside its leaf's bounds (:func:`core.specs.leaf_bounds`) and a discrete action respects the
request's action mask. An infinite side of a box gets a window of 10 next to the finite one (or around 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from core.specs import DictNode, Leaf, Node, leaf_bounds


def wire_dtype(leaf: Leaf) -> np.dtype:
    """The leaf's dtype in protocol arrays (a ``bfloat16`` leaf travels as ``float32``)."""
    return np.dtype("float32" if leaf.dtype == torch.bfloat16 else str(leaf.dtype).removeprefix("torch."))


def random_action(node: Node, rng: np.random.Generator, mask: np.ndarray | None = None) -> Any:
    """A legal random action of ``node``: an array for a leaf, a dict for a dict node.

    Args:
        node: the agent's action node.
        rng: the source of randomness.
        mask: ``[n]`` bool legal choices of a discrete leaf (None: all legal).
    """
    if isinstance(node, DictNode):
        return {name: random_action(child, rng) for name, child in node.children.items()}
    dtype = wire_dtype(node)
    if node.kind == "discrete" and mask is not None:
        return np.array(node.start + int(rng.choice(np.flatnonzero(mask))), dtype=dtype)
    low, high = (bound.numpy() for bound in leaf_bounds(node))
    if dtype.kind in "biu":  # within what the dtype holds (and what a float64 counts exactly)
        smallest, largest = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
        low, high = np.maximum(low, max(smallest, -2**52)), np.minimum(high, min(largest, 2**52))
    low = np.where(np.isfinite(low), low, np.where(np.isfinite(high), high - 10, -10))
    high = np.where(np.isfinite(high), high, low + 10)
    u = rng.random(node.shape)
    if dtype.kind in "biu":
        low, high = np.ceil(low), np.floor(high)
        return np.clip(np.floor(low + u * (high - low + 1)), low, high).astype(dtype)
    return np.clip(low + u * (high - low), low, high).astype(dtype)


__all__ = ["random_action", "wire_dtype"]
