"""Gymnasium spaces -> Shoal tree nodes, and fast numpy <-> torch conversion of batches of samples.

Mapping (``path`` names where a space sits, e.g. ``"agent_0/observation/pos"``):

=====================================  ==========================================================================
gymnasium                              Shoal
=====================================  ==========================================================================
``Box(low, high, shape, dtype)``       ``Leaf.box`` with the same shape, bounds and dtype
``Discrete(n, start)``                 ``Leaf.discrete(n, start)`` (values stay gymnasium's: ``start..start+n-1``)
``MultiDiscrete(nvec, start)``         ``Leaf.multi_discrete(nvec.flatten())``: a multi-dim ``nvec`` is flattened
                                       row-major; a non-zero ``start`` is subtracted on the way in and added back
                                       on the way out, so Shoal values are ``0..nvec-1``
``MultiBinary(n)``                     ``Leaf.binary(prod(n))`` (multi-dim ``n`` flattened row-major), int8
``Dict``                               ``DictNode`` with the same keys, in order
``Tuple``                              ``DictNode`` with keys ``"0"``, ``"1"``, ... (mixed child types are fine)
``Text``, ``Graph``, ``Sequence``,     :class:`UnsupportedSpaceError` naming the space and its path (variable
``OneOf``, anything else               size or structure has no fixed tensor layout)
=====================================  ==========================================================================

A :class:`SpaceCodec` converts a *batch* of samples (numpy arrays with leading batch dims, nested dicts /
tuples as vector envs produce them) into one numpy array per leaf without per-element Python loops, and a
list of per-leaf arrays back into gymnasium's structure (actions).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from gymnasium import spaces

from core.specs import DictNode, Leaf, Node, TreeError, leaf_bounds

from .checking import sample_problem

# Same rule as core.specs.nodes (names of dict children and agents).
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


class UnsupportedSpaceError(TreeError):
    """A gymnasium space with no fixed tensor layout; ``path`` says where it sits, ``space`` is the space."""

    def __init__(self, space: Any, path: str, reason: str) -> None:
        super().__init__(path, f"unsupported gymnasium space {type(space).__name__} ({space!r}): {reason}")
        self.space = space


_VARIABLE = (spaces.Text, spaces.Graph, spaces.Sequence, spaces.OneOf)
#: What to use instead of each variable-size space (named in the error).
_NEAREST = {
    spaces.Graph: "fixed-capacity Boxes (node features [max_nodes, F], edges [max_edges, 2] and a presence mask); "
                  "to choose a node, a Discrete(max_nodes) action under an action mask (see builtin:pick)",
    spaces.Sequence: "a Box of a fixed maximum length plus a MultiBinary presence mask",
    spaces.Text: "a MultiDiscrete of character codes of a fixed maximum length",
    spaces.OneOf: "a Dict of every option plus a Discrete choosing one (a non-atomic action Dict lets the env "
                  "execute only the chosen element)",
}


def torch_dtype(np_dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (``np.float32`` -> ``torch.float32``)."""
    return torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype


@dataclass(frozen=True, slots=True)
class LeafCodec:
    """How one gymnasium leaf space maps onto one Shoal leaf."""

    key: tuple[str, ...]
    """Key path of the leaf inside its node (``()`` for a bare leaf)."""
    access: tuple[str | int, ...]
    """Indices that reach the leaf inside a gymnasium sample (dict keys, tuple positions)."""
    leaf: Leaf
    """The Shoal leaf."""
    np_dtype: np.dtype
    """Numpy dtype of the leaf's arrays."""
    gym_shape: tuple[int, ...]
    """Shape of one gymnasium sample of the leaf (differs from ``leaf.shape`` when flattened)."""
    offset: np.ndarray | None
    """``MultiDiscrete.start`` (subtracted on the way in), or None."""


def space_to_node(space: spaces.Space, path: str = "", *, eval_only: bool = False) -> Node:
    """The Shoal node of a gymnasium space (module table); ``eval_only`` tags every leaf.

    Raises:
        UnsupportedSpaceError: for Text/Graph/Sequence/OneOf/unknown spaces, empty Dict/Tuple, or Dict keys
            that are not valid Shoal names; the message names the space and ``path``.
    """
    return _node(space, path, eval_only)


def _node(space, path: str, eval_only: bool) -> Node:
    if isinstance(space, spaces.Box):
        return Leaf.box(space.shape, low=space.low, high=space.high, dtype=torch_dtype(space.dtype),
                        eval_only=eval_only)
    if isinstance(space, spaces.Discrete):
        return Leaf.discrete(int(space.n), start=int(space.start), dtype=torch_dtype(space.dtype),
                             eval_only=eval_only)
    if isinstance(space, spaces.MultiDiscrete):
        return Leaf.multi_discrete(np.asarray(space.nvec).reshape(-1).tolist(), dtype=torch_dtype(space.dtype),
                                   eval_only=eval_only)
    if isinstance(space, spaces.MultiBinary):
        return Leaf.binary(math.prod(space.shape), dtype=torch_dtype(space.dtype), eval_only=eval_only)
    if isinstance(space, (spaces.Dict, spaces.Tuple)):
        items = list(space.spaces.items()) if isinstance(space, spaces.Dict) else \
            [(str(i), s) for i, s in enumerate(space.spaces)]
        if not items:
            raise UnsupportedSpaceError(space, path, "an empty Dict/Tuple has no leaves")
        children = {}
        for name, child in items:
            if not isinstance(name, str) or not _NAME.match(name):
                raise UnsupportedSpaceError(space, path, f"key {name!r} is not a name of letters, digits, '_', '-'")
            children[name] = _node(child, f"{path}/{name}" if path else name, eval_only)
        return DictNode(children)
    if isinstance(space, _VARIABLE):
        nearest = next(hint for kind, hint in _NEAREST.items() if isinstance(space, kind))
        raise UnsupportedSpaceError(space, path, "variable size or structure has no fixed tensor layout; nearest "
                                                 f"valid choice: {nearest}")
    raise UnsupportedSpaceError(space, path, "no Shoal leaf for this space type")


def _codecs(space, key: tuple[str, ...], access: tuple) -> list[LeafCodec]:
    if isinstance(space, spaces.Dict):
        return [c for name, s in space.spaces.items() for c in _codecs(s, (*key, name), (*access, name))]
    if isinstance(space, spaces.Tuple):
        return [c for i, s in enumerate(space.spaces) for c in _codecs(s, (*key, str(i)), (*access, i))]
    leaf = _node(space, "/".join(key), False)
    offset = None
    if isinstance(space, spaces.MultiDiscrete) and np.any(space.start != 0):
        offset = np.asarray(space.start, dtype=space.dtype).reshape(-1)
    return [LeafCodec(key, access, leaf, np.dtype(space.dtype), tuple(space.shape), offset)]


class SpaceCodec:
    """Batch conversion between gymnasium samples of one space and one numpy array per Shoal leaf.

    Arrays "in Shoal form" have shape ``[*batch, *leaf.shape]`` and the leaf's dtype.
    """

    def __init__(self, space: spaces.Space, path: str = "") -> None:
        space_to_node(space, path)  # raises, naming the path, before anything else
        self.space = space
        self.leaves: tuple[LeafCodec, ...] = tuple(_codecs(space, (), ()))
        self._bare = len(self.leaves) == 1 and not self.leaves[0].access
        self._plain = all(c.offset is None and c.gym_shape == c.leaf.shape for c in self.leaves)
        self.pads = [pad_value(c.leaf) for c in self.leaves]
        self._zero_pad = [not pad.any() for pad in self.pads]
        self._layouts: dict[tuple[int, ...], list[tuple]] = {}  # batch -> (shape, dtype, pad or None) per leaf
        leaf = self.leaves[0]
        #: ``(shape, dtype)`` of a sample that can be written as is (one plain leaf), else None.
        self.plain = (leaf.gym_shape, leaf.np_dtype) if self._bare and self._plain else None

    def buffers(self, batch: tuple[int, ...]) -> list[np.ndarray]:
        """Fresh arrays ``[*batch, *leaf.shape]``, one per leaf, filled with the padding value.

        The per-leaf shapes are worked out once per batch shape (adapters call this every step).
        """
        layout = self._layouts.get(batch)
        if layout is None:
            layout = self._layouts[batch] = [((*batch, *c.leaf.shape), c.np_dtype, None if zero else pad)
                                             for c, pad, zero in zip(self.leaves, self.pads, self._zero_pad)]
        return [np.zeros(shape, dtype) if pad is None else np.full(shape, pad, dtype) for shape, dtype, pad in layout]

    def write(self, sample, bufs: Sequence[np.ndarray], index) -> tuple[tuple[str, ...], str] | None:
        """Writes one sample (no batch dims) into ``bufs[i][index]``.

        Returns:
            None, or ``(leaf key, problem)`` for the first leaf that is missing or has a wrong shape or dtype
            (that leaf and the following ones are not written).
        """
        for c, buf in zip(self.leaves, bufs):
            value = sample
            try:
                for k in c.access:
                    value = value[k]
            except (KeyError, IndexError, TypeError):
                return c.key, "missing"
            arr = value if type(value) is np.ndarray else np.asarray(value)
            if arr.shape != c.gym_shape or arr.dtype != c.np_dtype:
                problem = sample_problem(arr, c.gym_shape, c.np_dtype)
                if problem is not None:
                    return c.key, problem
            if c.gym_shape != c.leaf.shape:
                arr = arr.reshape(c.leaf.shape)
            buf[index] = arr if c.offset is None else arr - c.offset
        return None

    def flatten(self, sample, batch: tuple[int, ...]) -> list[np.ndarray]:
        """Gymnasium sample(s) with leading ``batch`` dims -> list of arrays ``[*batch, *leaf.shape]``.

        No dtype or shape check here (see :mod:`adapters.checking`); arrays are not copied when already right.
        """
        if self._bare and self._plain:
            return [np.asarray(sample)]
        out = []
        for c in self.leaves:
            value = sample
            for k in c.access:
                value = value[k]
            arr = np.asarray(value)
            if c.gym_shape != c.leaf.shape:
                arr = arr.reshape(*batch, *c.leaf.shape)
            if c.offset is not None:
                arr = arr - c.offset
            out.append(arr)
        return out

    def unflatten(self, arrays: Sequence[np.ndarray], batch: tuple[int, ...]):
        """List of arrays ``[*batch, *leaf.shape]`` -> gymnasium structure (nested dict / tuple of arrays)."""
        if self._bare and self._plain:
            return arrays[0]
        values = []
        for c, arr in zip(self.leaves, arrays):
            if c.offset is not None:
                arr = arr + c.offset
            if c.gym_shape != c.leaf.shape:
                arr = arr.reshape(*batch, *c.gym_shape)
            values.append(arr)
        return _rebuild(self.space, iter(values))


def _rebuild(space, values):
    if isinstance(space, spaces.Dict):
        return {name: _rebuild(s, values) for name, s in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(_rebuild(s, values) for s in space.spaces)
    return next(values)


def pad_value(leaf: Leaf) -> np.ndarray:
    """The value absent slots hold: zero clamped into the leaf's bounds (``core.specs.zeros`` does the same)."""
    low, high = leaf_bounds(leaf)
    return torch.zeros(leaf.shape, dtype=torch.float64).clamp(low, high).to(leaf.dtype).numpy()


__all__ = ["LeafCodec", "SpaceCodec", "UnsupportedSpaceError", "pad_value", "space_to_node", "torch_dtype"]
