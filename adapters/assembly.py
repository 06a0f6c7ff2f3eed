"""Numpy arrays -> one step TensorDict in the layout of :mod:`core.layout`, built explicitly and cheaply.

Adapters collect a step as numpy arrays (one per leaf, reward, flag and mask) and call :meth:`StepLayout.build`
once: every array becomes a tensor with ``torch.from_numpy`` (no copy) and the TensorDicts are built with
explicit batch sizes and no per-key checks (the shapes were checked by the adapter; ``from_dict`` costs ~0.7 ms
per step, see notes/tensordict-hot-paths.md). The returned tensors share memory with the arrays: adapters hand
over fresh arrays every step and never write into them afterwards.

A group whose action is structured (non-atomic elements or conditional leaves, :mod:`core.specs.structure`)
carries its action mask as a tree: the adapter gives ``{path: array}`` (paths of
:func:`core.specs.action_mask_shapes`, e.g. ``("transform",)`` ``[E, A, n_node, n_transform]`` or
``("@present", "transform")`` ``[E, A]``); entries it leaves out are all True (legal / executed).

Masks that say "everything" (every agent present, every action legal) and end flags that say "nothing ended"
are given as None and become constant tensors (all True, all False) built once and shared by every step:
consumers treat step tensors as read-only (they stack or read them), so sharing is safe and saves an
allocation and a conversion per step (a few µs each, on the per-step path of every env).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict

from core.layout import (ACTION_MASK, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED,
                         all_true)
from core.specs import GroupSpec, Leaf, Node, Tree, action_mask_shapes, groups, iter_leaves, shared_observations
from core.tensordicts import get_str, make_td, nested_td  # noqa: F401  (re-exported: the adapters' constructor)

def _nest(node: Node, tensors, batch: torch.Size):
    if isinstance(node, Leaf):
        return next(tensors)
    return make_td({k: _nest(c, tensors, batch) for k, c in node.children.items()}, batch)


@dataclass(slots=True)
class GroupStep:
    """What one group observes at a step (numpy, ``E`` envs, ``A`` slots)."""

    observation: list[np.ndarray]
    """One array per observation leaf (``iter_leaves`` order), ``[E, A, *leaf.shape]``."""
    mask: np.ndarray | None
    """``[E, A]`` bool: agent present (acts at this step); None: every agent."""
    action_mask: np.ndarray | Mapping[tuple[str, ...], np.ndarray] | None = None
    """``[E, A, n]`` bool legal actions, for a group whose action is one discrete leaf; for a structured action,
    ``{path: bool array [E, A, *shape]}`` (module doc; missing paths all True); None: all legal and present
    (groups without a discrete or structured action carry no action mask)."""


@dataclass(slots=True)
class GroupNext:
    """Consequences of a step for one group (numpy)."""

    observation: list[np.ndarray]
    """One array per observation leaf, ``[E, A, *leaf.shape]``."""
    reward: np.ndarray
    """``[E, A]`` float32."""
    terminated: np.ndarray | None
    """``[E, A]`` bool; None (with ``truncated`` None): no agent of the group ended at this step."""
    truncated: np.ndarray | None
    """``[E, A]`` bool; None (with ``terminated`` None): no agent of the group ended at this step."""
    mask: np.ndarray | None
    """``[E, A]`` bool: agent present at the step (the root mask of the input step); None: every agent."""
    done: np.ndarray | None = None
    """``terminated | truncated`` when the adapter has it already (else computed here)."""


def action_mask_size(spec: GroupSpec) -> int | None:
    """``n`` when the group's action is one discrete leaf (it then carries an action mask), else None."""
    node = spec.agent.action
    return node.n if isinstance(node, Leaf) and node.kind == "discrete" else None


class StepLayout:
    """Keys and batch sizes of the steps of one tree with ``num_envs`` envs, fixed once."""

    def __init__(self, tree: Tree, num_envs: int) -> None:
        self.groups: dict[str, GroupSpec] = groups(tree)
        shared = shared_observations(tree)
        if set(shared) - {()}:
            raise ValueError("adapters support one shared observation, at the root population")
        self.shared: Node | None = shared.get(())
        self.num_envs = num_envs
        self._env_batch = torch.Size([num_envs])
        self._group_batch = {name: torch.Size([num_envs, g.capacity]) for name, g in self.groups.items()}
        # constant all-True masks, shared by every step (module doc)
        self._all_present = {name: all_true(*b) for name, b in self._group_batch.items()}
        self._none_ended = {name: torch.zeros(*b, 1, dtype=torch.bool) for name, b in self._group_batch.items()}
        self._no_env_ended = torch.zeros(num_envs, 1, dtype=torch.bool)
        self._all_legal = {name: all_true(*self._group_batch[name], n)
                           for name, g in self.groups.items() if (n := action_mask_size(g)) is not None}
        # structured actions: path -> all-True constant, per group (the defaults of the mask tree)
        self._mask_tree = {name: {path: all_true(*self._group_batch[name], *shape) for path, shape in shapes.items()}
                           for name, g in self.groups.items()
                           if (shapes := action_mask_shapes(g.agent.action)) is not None}

    def obs_leaves(self, name: str) -> list[tuple[tuple[str, ...], Leaf]]:
        """``(key path, leaf)`` of the observation of group ``name``, in array order."""
        return list(iter_leaves(self.groups[name].agent.observation))

    def _observation(self, node: Node, arrays: list[np.ndarray], batch: torch.Size):
        if isinstance(node, Leaf):
            return torch.from_numpy(arrays[0])
        return _nest(node, iter([torch.from_numpy(a) for a in arrays]), batch)

    def build(self, root: list[GroupStep], shared: list[np.ndarray] | None = None,
              nxt: list[GroupNext] | None = None, next_shared: list[np.ndarray] | None = None,
              env_terminated: np.ndarray | None = None, env_truncated: np.ndarray | None = None) -> TensorDict:
        """The step TensorDict, batch ``[env]``: the root (what to act on) and, unless ``nxt`` is None, ``"next"``.

        Args:
            root: one :class:`GroupStep` per group, in :attr:`groups` order.
            shared: the root shared observation, one array ``[E, *leaf.shape]`` per leaf (when the tree has one).
            nxt: one :class:`GroupNext` per group, or None for a reset.
            next_shared: the shared observation after the step.
            env_terminated: ``[E]`` bool env-level flag (with ``nxt``); both None: no env ended.
            env_truncated: ``[E]`` bool env-level flag (with ``nxt``); both None: no env ended.
        """
        out = {}
        # built first: a root observation that is the "next" one (same arrays) reuses its tensors
        next_td = self._build_next(nxt, next_shared, env_terminated, env_truncated) if nxt is not None else None
        for (name, spec), g, n in zip(self.groups.items(), root, nxt or root):
            batch = self._group_batch[name]
            if next_td is not None and g.observation is n.observation:
                obs = get_str(get_str(next_td, name), OBSERVATION)
            else:
                obs = self._observation(spec.agent.observation, g.observation, batch)
            entries = {OBSERVATION: obs,
                       MASK: self._all_present[name] if g.mask is None else torch.from_numpy(g.mask)}
            if (defaults := self._mask_tree.get(name)) is not None:
                entries[ACTION_MASK] = self._tree_mask(name, defaults, g.action_mask, batch)
            elif g.action_mask is not None:
                entries[ACTION_MASK] = torch.from_numpy(g.action_mask)
            elif (legal := self._all_legal.get(name)) is not None:
                entries[ACTION_MASK] = legal
            out[name] = make_td(entries, batch)
        if self.shared is not None:
            out[SHARED] = get_str(next_td, SHARED) if next_td is not None and shared is next_shared else \
                self._observation(self.shared, shared, self._env_batch)
        if next_td is not None:
            out[NEXT] = next_td
        return make_td(out, self._env_batch)

    @staticmethod
    def _tree_mask(name: str, defaults: dict, given, batch: torch.Size) -> TensorDict:
        """The mask tree of a structured action: the adapter's arrays over all-True defaults (module doc)."""
        leaves = dict(defaults)
        if given is not None:
            if not isinstance(given, Mapping):
                raise ValueError(f"group {name!r} has a structured action: give its action mask as {{path: array}} "
                                 f"with paths among {sorted(defaults)}")
            for path, array in given.items():
                path = tuple(path)
                if path not in defaults:
                    raise ValueError(f"group {name!r}: action mask path {path} is not one of {sorted(defaults)}")
                leaves[path] = torch.from_numpy(array)
        tree: dict = {}
        for path, tensor in leaves.items():
            node = tree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = tensor
        return nested_td(tree, batch)

    def _build_next(self, nxt, next_shared, env_terminated, env_truncated) -> TensorDict:
        e = self.num_envs
        if env_terminated is None and env_truncated is None:
            env_term = env_trunc = env_done = self._no_env_ended
        else:
            env_term = torch.from_numpy(env_terminated.reshape(e, 1))
            env_trunc = torch.from_numpy(env_truncated.reshape(e, 1))
            given = nxt[0].done if len(nxt) == 1 and nxt[0].terminated is env_terminated else None
            env_done_array = env_terminated | env_truncated if given is None else given
            env_done = torch.from_numpy(env_done_array.reshape(e, 1))
        out = {}
        for (name, spec), g in zip(self.groups.items(), nxt):
            batch = self._group_batch[name]
            a = batch[1]
            if g.terminated is None and g.truncated is None:
                term = trunc = done = self._none_ended[name]
            elif a == 1 and g.terminated is env_terminated and g.truncated is env_truncated:
                # one agent per env whose flags are the env's: the same memory, viewed [E, 1, 1] (from_numpy of
                # a reshaped array is cheaper than indexing the tensor)
                term = torch.from_numpy(env_terminated.reshape(e, 1, 1))
                trunc = torch.from_numpy(env_truncated.reshape(e, 1, 1))
                done = torch.from_numpy(env_done_array.reshape(e, 1, 1))
            else:
                term = torch.from_numpy(g.terminated.reshape(e, a, 1))
                trunc = torch.from_numpy(g.truncated.reshape(e, a, 1))
                done = torch.from_numpy((g.terminated | g.truncated if g.done is None else g.done).reshape(e, a, 1))
            out[name] = make_td({
                OBSERVATION: self._observation(spec.agent.observation, g.observation, batch),
                REWARD: torch.from_numpy(g.reward.reshape(e, a, 1)),
                TERMINATED: term, TRUNCATED: trunc, DONE: done,
                MASK: self._all_present[name] if g.mask is None else torch.from_numpy(g.mask),
            }, batch)
        if self.shared is not None:
            out[SHARED] = self._observation(self.shared, next_shared, self._env_batch)
        out[TERMINATED], out[TRUNCATED], out[DONE] = env_term, env_trunc, env_done
        return make_td(out, self._env_batch)


class AdapterBase:
    """The read-only protocol properties every adapter shares (``_tree``, ``_num_envs``, ``_checker`` set by it)."""

    _tree: Tree
    _num_envs: int
    last_cut: np.ndarray = np.zeros(0, dtype=np.int64)
    """The env indices whose episode the last ``step`` cut with a lenient repair (:mod:`adapters.protocol`)."""

    @property
    def tree(self) -> Tree:
        """The observation/action tree shared by all envs."""
        return self._tree

    @property
    def num_envs(self) -> int:
        """Number of envs in the batch."""
        return self._num_envs

    @property
    def counters(self) -> dict[str, int]:
        """Running counts of repaired or lost data (see :mod:`adapters.checking`)."""
        return dict(self._checker.counters)

    @property
    def recent_errors(self) -> list:
        """The last :class:`~adapters.checking.EnvOutputError` s met in lenient mode (newest last)."""
        return list(self._checker.recent)


__all__ = ["AdapterBase", "GroupNext", "GroupStep", "StepLayout", "action_mask_size", "make_td", "nested_td"]
