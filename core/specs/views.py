"""Views of a tree: the deployment view drops what only training may see."""

from __future__ import annotations

from dataclasses import replace

from .nodes import AgentNode, ArrayPopulation, DictNode, DictPopulation, Leaf, Node, Tree


def _without_eval_only(node: Node | None) -> Node | None:
    if node is None or isinstance(node, Leaf):
        return None if node is None or node.eval_only else node
    kept = {k: c for k, c in ((k, _without_eval_only(c)) for k, c in node.children.items()) if c is not None}
    return DictNode(kept, atomic=node.atomic) if kept else None


def deployment_view(tree: Tree) -> Tree:
    """``tree`` without ``eval_only`` observation leaves (and without dict nodes left empty by that).

    Shared observations made only of eval-only leaves disappear. A deployed policy must see something, so
    an agent whose every observation leaf is eval-only raises.

    Raises:
        ValueError: naming the agent whose every observation leaf is eval-only.
    """
    if isinstance(tree, AgentNode):
        obs = _without_eval_only(tree.observation)
        if obs is None:
            raise ValueError("every observation leaf of the agent is eval_only: nothing left to deploy")
        return AgentNode(observation=obs, action=tree.action)
    if isinstance(tree, ArrayPopulation):
        try:
            template = deployment_view(tree.template)
        except ValueError as err:
            raise ValueError(f"array population template: {err}") from None
        return replace(tree, template=template, shared_observation=_without_eval_only(tree.shared_observation))
    members = {}
    for name, member in tree.members.items():
        try:
            members[name] = deployment_view(member)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    return DictPopulation(members=members, payoff=tree.payoff,
                          shared_observation=_without_eval_only(tree.shared_observation))


__all__ = ["deployment_view"]
