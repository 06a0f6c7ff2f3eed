"""Composite actions: one head per leaf of an action tree; joint log-probability and entropy are sums.

The leaves of the action node are independent given the actor output (a product distribution), so for a
dict action ``{"move": Discrete(5), "aim": Box(2)}`` the joint ``log_prob = log_prob(move) + log_prob(aim)``
and ``entropy = H(move) + H(aim)``. Actions travel as a list of leaf tensors in :func:`core.specs.iter_leaves`
order (``paths``); :mod:`core.policies.actor_critic` writes them back as the action tree.

An action mask (``[*B, n]`` bool, :mod:`core.layout`) applies to an action node that is a single discrete
(``n``) or multi-discrete (``n = sum(nvec)``) leaf.

Structured actions (issue 15, :mod:`core.specs.structure`) take the mask as a *tree* (a TensorDict or nested
dict, batch ``[*B]``) keyed like the action tree: ``mask[*leaf]`` ``[*B, n]`` per discrete / multi-discrete
leaf (any missing entry: all legal), ``mask[*leaf]`` ``[*B, n_A, n]`` for a leaf conditioned on leaf A, and
``mask["@present", *element]`` ``[*B]`` per element of a non-atomic dict (missing: present). A plain dict
action takes such a tree too. Then, with ``pres_i`` the presence of leaf ``i`` (the AND of its elements')::

    log_prob = sum_i pres_i * log p_i(a_i | a_given(i))           (absent elements add exactly 0)
    entropy  = sum_i pres_i * H_i,  H_i = H(p_i)                   (an unconditioned leaf)
                                    H_i = sum_a p_A(a) H(p_i(. | a)) (leaf i conditioned on leaf A)

so for ``A -> B`` both present the entropy is the exact joint ``H(A, B) = H(A) + E_a[H(B | a)]``, not an
estimate under the sampled first choice. A leaf is sampled (and gets a value) even when absent; a leaf
conditioned on an absent one is drawn from the row of the value drawn for it. A conditioning leaf A is sampled
under its mask AND "some value of B is legal in row a" (where B is present), so a sampled pair is never
illegal while one legal pair exists. Rows with no legal value at all (padded agents) stay finite (uniform).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from core.layout import ACTION_PRESENT, is_all_true
from core.specs import (DictNode, Leaf, Node, action_conditions, action_elements, check_node, is_structured,
                        iter_leaves)

from .conditional import ConditionalCategoricalHead
from .distributions import _masked, make_head

_MASKABLE = ("discrete", "multi_discrete")


class ActionHeads(nn.Module):
    """The heads of one action node; ``params`` ``[*B, num_params]`` is split among them in leaf order.

    Every method takes ``mask``: None, a ``[*B, n]`` bool tensor (a single discrete / multi-discrete leaf), or a
    mask tree (TensorDict or nested dict ``[*B]``, module doc) for a dict or structured action.

    Attributes:
        paths: key path of every action leaf (``[()]`` for a bare leaf).
        heads: one :class:`core.policies.distributions.Head` per path (a
            :class:`core.policies.conditional.ConditionalCategoricalHead` for a conditioned leaf, whose params are
            an ``[n_A * n]`` logits table).
        num_params: width of the actor output the heads consume.
        given: per leaf, the index of the leaf it is conditioned on, or None.
        structured: the node has non-atomic elements or conditional leaves (masks are always read as trees).
    """

    def __init__(self, node: Node, *, log_std_init: float = 0.0, squash_bounded: bool = True,
                 name: str = "action") -> None:
        super().__init__()
        if isinstance(node, DictNode):
            check_node(node, "action", role="action")  # StructuredActionError names a bad conditional leaf
        items = list(iter_leaves(node))
        self.paths = [p for p, _ in items]
        where = {p: i for i, p in enumerate(self.paths)}
        conditions = action_conditions(node)
        #: per leaf, the index of the leaf it is conditioned on (None: unconditioned)
        self.given = [where[conditions[p]] if p in conditions else None for p in self.paths]
        heads = []
        for (path, leaf), g in zip(items, self.given):
            try:
                heads.append(make_head(leaf, log_std_init=log_std_init, squash_bounded=squash_bounded) if g is None
                             else ConditionalCategoricalHead(leaf, items[g][1]))
            except ValueError as err:  # a leaf no head takes (an integer box): named by where it is
                raise ValueError(f"{'/'.join((name, *path))}: {err}") from None
        self.heads = nn.ModuleList(heads)
        self.kinds = [leaf.kind for _, leaf in items]
        self.sizes = [h.num_params for h in self.heads]
        self.num_params = sum(self.sizes)
        self.maskable = isinstance(node, Leaf) and node.kind in _MASKABLE
        #: non-atomic or conditional: the mask is always read as a tree (module doc)
        self.structured = is_structured(node)
        elements = action_elements(node)
        #: per leaf, the elements whose presence it needs (the children of non-atomic dicts above it)
        self.leaf_elements = [[e for e in elements if p[: len(e)] == e] for p in self.paths]
        #: per leaf, the leaves conditioned on it
        self.dependents = [[i for i, g in enumerate(self.given) if g == j] for j in range(len(self.paths))]
        self._mask_keys = {*self.paths, *((ACTION_PRESENT, *e) for e in elements)}
        #: every head recomputes a sampled action's log-probability exactly from its params (``Head.exact_log_prob``)
        self.exact_log_prob = all(h.exact_log_prob for h in self.heads)

    def as_tree(self, leaves: Sequence[Tensor]):
        """Per-leaf actions (``paths`` order) as the action: the tensor of a bare leaf, else nested dicts."""
        if len(leaves) == 1 and self.paths[0] == ():
            return leaves[0]
        out: dict = {}
        for path, x in zip(self.paths, leaves):
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = x
        return out

    def _split(self, params: Tensor, mask: Tensor | None) -> Sequence[Tensor]:
        if mask is not None and not self.maskable:
            raise ValueError("an action mask needs a single discrete or multi_discrete action leaf")
        if params.shape[-1] != self.num_params:
            raise ValueError(f"params end with {params.shape[-1]}, the heads need {self.num_params}")
        return (params,) if len(self.heads) == 1 else params.split(self.sizes, -1)

    def sample(self, params: Tensor, generator: torch.Generator | None,
               mask: Tensor | None = None) -> tuple[list[Tensor], Tensor]:
        """Random actions (one tensor per leaf) and their joint log-probability ``[*B, 1]``."""
        if self._tree_mode(mask):
            return self._sample_tree(params, generator, mask, True)
        actions, total = [], None
        for head, p in zip(self.heads, self._split(params, mask)):
            action, log_prob = head.sample(p, generator, mask)
            actions.append(action)
            total = log_prob if total is None else total + log_prob
        return actions, total

    def sample_actions(self, params: Tensor, generator: torch.Generator | None,
                       mask: Tensor | None = None) -> list[Tensor]:
        """The actions of :meth:`sample` (same random draws), without the log-probability."""
        if self._tree_mode(mask):
            return self._sample_tree(params, generator, mask, False)[0]
        return [head.sample_action(p, generator, mask) for head, p in zip(self.heads, self._split(params, mask))]

    def log_prob(self, params: Tensor, actions: Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
        """Joint log-probability ``[*B, 1]`` of ``actions`` (one tensor per leaf, ``paths`` order).

        Summed leaf by leaf in order, as :meth:`sample` does, so a sampled action's value is the same bits.
        """
        if len(actions) != len(self.heads):
            raise ValueError(f"{len(actions)} action tensors for {len(self.heads)} action leaves")
        if self._tree_mode(mask):
            return self._log_prob_tree(params, actions, mask)
        total = None
        for h, p, a in zip(self.heads, self._split(params, mask), actions):
            part = h.log_prob(p, a, mask)
            total = part if total is None else total + part
        return total

    def log_prob_entropy(self, params: Tensor, actions: Sequence[Tensor],
                         mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(log_prob(params, actions, mask), entropy(params, mask))``, sharing each head's work."""
        if len(actions) != len(self.heads):
            raise ValueError(f"{len(actions)} action tensors for {len(self.heads)} action leaves")
        if self._tree_mode(mask):
            return self._log_prob_tree(params, actions, mask), self._entropy_tree(params, mask)
        parts = [h.log_prob_entropy(p, a, mask) for h, p, a in zip(self.heads, self._split(params, mask), actions)]
        if len(parts) == 1:
            return parts[0]
        return torch.stack([lp for lp, _ in parts]).sum(0), torch.stack([h for _, h in parts]).sum(0)

    def entropy(self, params: Tensor, mask: Tensor | None = None) -> Tensor:
        """Joint entropy ``[*B, 1]`` (sum over leaves; structured actions: module doc)."""
        if self._tree_mode(mask):
            return self._entropy_tree(params, mask)
        parts = [h.entropy(p, mask) for h, p in zip(self.heads, self._split(params, mask))]
        return parts[0] if len(parts) == 1 else torch.stack(parts).sum(0)

    def mode(self, params: Tensor, mask: Tensor | None = None) -> list[Tensor]:
        """Deterministic actions (masked argmax, Gaussian mean, squashed mean, ``logit > 0``), one per leaf."""
        if self._tree_mode(mask):
            return self._mode_tree(params, mask)
        return [h.mode(p, mask) for h, p in zip(self.heads, self._split(params, mask))]

    # ---------------------------------------------------------------------------- structured actions (tree masks)
    def _tree_mode(self, mask) -> bool:
        return self.structured or (mask is not None and not isinstance(mask, Tensor))

    def _read(self, mask) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """Per leaf: its legal-value mask (or table) and its presence ``[*B]`` (None: no mask / present)."""
        n = len(self.paths)
        if mask is None:
            return [None] * n, [None] * n
        if isinstance(mask, Tensor):
            raise ValueError("a structured or dict action takes its action mask as a tree keyed like the action "
                             "(core.specs.structure), not one tensor")
        extra = sorted(k for k in _leaf_keys(mask) if k not in self._mask_keys)
        if extra:
            raise ValueError(f"action mask entries {['/'.join(k) for k in extra]} match no maskable action leaf "
                             f"or non-atomic element (expected some of {sorted('/'.join(k) for k in self._mask_keys)})")
        masks = []
        for path, kind, head in zip(self.paths, self.kinds, self.heads):
            m = _get(mask, path)
            if m is not None:
                if kind not in _MASKABLE:
                    raise ValueError(f"action_mask/{'/'.join(path)}: a {kind} action leaf takes no action mask")
                if isinstance(head, ConditionalCategoricalHead) and not is_all_true(m):
                    head.check_table(m, m.shape[:-2])
            masks.append(m)
        present = []
        for elements in self.leaf_elements:
            p = None
            for e in elements:
                x = _get(mask, (ACTION_PRESENT, *e))
                if x is not None and not is_all_true(x):
                    p = x if p is None else p & x
            present.append(p)
        return masks, present

    def _leaf_mask(self, i: int, masks, present) -> Tensor | None:
        """Leaf ``i``'s mask, narrowed (when leaves are conditioned on it) to values with a legal follow-up."""
        m = masks[i]
        for k in self.dependents[i]:
            if masks[k] is None or is_all_true(masks[k]):
                continue
            ok = masks[k].any(-1)
            if present[k] is not None:
                ok = ok | ~present[k].unsqueeze(-1)
            m = ok if m is None or is_all_true(m) else m & ok
        return m

    def _sample_tree(self, params: Tensor, generator, mask, with_log_prob: bool):
        masks, present = self._read(mask)
        actions, parts = [], []
        for i, (head, p) in enumerate(zip(self.heads, self._split(params, None))):
            j = self.given[i]
            if j is not None:
                a, lp = head.sample_given(p, actions[j], generator, masks[i]) if with_log_prob else \
                    (head.sample_action_given(p, actions[j], generator, masks[i]), None)
            else:
                m = self._leaf_mask(i, masks, present)
                a, lp = head.sample(p, generator, m) if with_log_prob else (head.sample_action(p, generator, m), None)
            actions.append(a)
            parts.append(lp)
        return actions, (_total(parts, present) if with_log_prob else None)

    def _log_prob_tree(self, params: Tensor, actions: Sequence[Tensor], mask) -> Tensor:
        masks, present = self._read(mask)
        parts = []
        for i, (head, p, a) in enumerate(zip(self.heads, self._split(params, None), actions)):
            j = self.given[i]
            parts.append(head.log_prob(p, a, self._leaf_mask(i, masks, present)) if j is None
                         else head.log_prob_given(p, actions[j], a, masks[i]))
        return _total(parts, present)

    def _entropy_tree(self, params: Tensor, mask) -> Tensor:
        masks, present = self._read(mask)
        split = self._split(params, None)
        leaf_masks = [self._leaf_mask(i, masks, present) if g is None else None for i, g in enumerate(self.given)]
        parts = []
        for i, (head, p) in enumerate(zip(self.heads, split)):
            j = self.given[i]
            if j is None:
                parts.append(head.entropy(p, leaf_masks[i]))
            else:
                m = leaf_masks[j]
                probs = (split[j] if m is None or is_all_true(m) else _masked(split[j], m)).softmax(-1)
                parts.append(head.entropy_given(p, probs, masks[i]))
        return _total(parts, present)

    def _mode_tree(self, params: Tensor, mask) -> list[Tensor]:
        masks, present = self._read(mask)
        actions = []
        for i, (head, p) in enumerate(zip(self.heads, self._split(params, None))):
            j = self.given[i]
            actions.append(head.mode(p, self._leaf_mask(i, masks, present)) if j is None
                           else head.mode_given(p, actions[j], masks[i]))
        return actions


def _get(tree, path: tuple[str, ...]):
    """The entry of a mask tree (TensorDict or nested dict) at ``path``, or None."""
    node = tree
    for key in path:
        if isinstance(node, Tensor):
            return None
        node = node.get(key, None)
        if node is None:
            return None
    return node


def _leaf_keys(tree, prefix: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, Tensor):
            yield (*prefix, key)
        else:
            yield from _leaf_keys(value, (*prefix, key))


def _total(parts: Sequence[Tensor], present: Sequence[Tensor | None]) -> Tensor:
    """``sum_i present_i * parts_i`` ``[*B, 1]``, summed in leaf order (:meth:`ActionHeads.sample` and
    :meth:`ActionHeads.log_prob` share it, so their bits agree); an absent part adds exactly 0."""
    total = None
    for part, p in zip(parts, present):
        if p is not None:
            if p.shape != part.shape[:-1] or p.dtype != torch.bool:
                raise ValueError(f"action presence mask {tuple(p.shape)} {p.dtype} must be bool "
                                 f"{tuple(part.shape[:-1])}")
            part = torch.where(p.unsqueeze(-1), part, torch.zeros((), dtype=part.dtype, device=part.device))
        total = part if total is None else total + part
    return total


__all__ = ["ActionHeads"]
