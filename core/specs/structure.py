"""Structured actions (issue 15): non-atomic elements and conditional leaves of an action tree, and the
layout of the per-leaf action mask that carries both.

An action node is *structured* when some :class:`~core.specs.nodes.DictNode` in it is non-atomic
(``atomic=False``) or conditions a child on a sibling (``conditional``). Its action mask is then a tree,
``(group, "action_mask")`` with batch ``[*B, A]`` (:mod:`core.layout`)::

    (*leaf,)               [*B, A, n]         discrete leaf: legal values
    (*leaf,)               [*B, A, sum(nvec)] multi-discrete leaf: legal values, components concatenated
    (*leaf,)               [*B, A, n_X, n]    discrete leaf conditioned on discrete leaf X: row x is legal when
                                              X chose x (the env's table)
    ("@present", *element) [*B, A]            an element (a child of a non-atomic dict) is executed at this step

Element paths and leaf paths are relative to the action root (``iter_leaves`` paths). A plain (atomic,
unconditioned) dict action may still be given per-leaf masks; its spec declares none.
"""

from __future__ import annotations

from core.layout import ACTION_PRESENT

from .nodes import DictNode, Leaf, Node, iter_leaves

Path = tuple[str, ...]


def action_elements(node: Node, prefix: Path = ()) -> list[Path]:
    """Paths of the elements (children of non-atomic dict nodes) of ``node``, pre-order."""
    if isinstance(node, Leaf):
        return []
    out: list[Path] = []
    for name, child in node.children.items():
        if not node.atomic:
            out.append((*prefix, name))
        out.extend(action_elements(child, (*prefix, name)))
    return out


def action_conditions(node: Node, prefix: Path = ()) -> dict[Path, Path]:
    """``{conditioned leaf path: path of the discrete leaf it is conditioned on}`` over the whole tree."""
    if isinstance(node, Leaf):
        return {}
    out = {(*prefix, name): (*prefix, given) for name, given in node.conditional.items()}
    for name, child in node.children.items():
        out.update(action_conditions(child, (*prefix, name)))
    return out


def is_structured(node: Node) -> bool:
    """Whether ``node`` has a non-atomic dict or a conditional leaf (its action mask is then a tree)."""
    return isinstance(node, DictNode) and bool(action_elements(node) or action_conditions(node))


def _leaf_at(node: Node, path: Path) -> Leaf:
    for key in path:
        node = node.children[key]
    return node


def action_mask_shapes(node: Node) -> dict[Path, tuple[int, ...]] | None:
    """Per-agent shapes (after ``[*B, A]``) of every entry of a structured node's mask tree (module doc),
    keyed by their path under ``"action_mask"``; None for a node that is not structured."""
    if not is_structured(node):
        return None
    conditions = action_conditions(node)
    out: dict[Path, tuple[int, ...]] = {}
    for path, leaf in iter_leaves(node):
        if leaf.kind == "discrete":
            given = conditions.get(path)
            out[path] = (leaf.n,) if given is None else (_leaf_at(node, given).n, leaf.n)
        elif leaf.kind == "multi_discrete":
            out[path] = (sum(leaf.nvec),)
    for element in action_elements(node):
        out[(ACTION_PRESENT, *element)] = ()
    return out


__all__ = ["action_conditions", "action_elements", "action_mask_shapes", "is_structured"]
