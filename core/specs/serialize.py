"""A JSON form of the tree, lossless, for checkpoints and the external-env handshake.

Plain JSON only (no pickle): infinite bounds are written as the strings ``"inf"`` / ``"-inf"`` and dtypes
by name (``"float32"``). A document carries ``"format": "shoal.tree/1"``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from .nodes import AgentNode, ArrayPopulation, DictNode, DictPopulation, Leaf, Node, Tree, TreeError

FORMAT = "shoal.tree/1"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool)}


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _unnum(x) -> float:
    return float(x)  # float("inf") / float("-inf") parse the strings written by _num


def _bound_out(b):
    return [_num(v) for v in b] if isinstance(b, tuple) else _num(b)


def _bound_in(b):
    return tuple(_unnum(v) for v in b) if isinstance(b, list) else _unnum(b)


def node_to_dict(node: Node | None) -> dict[str, Any] | None:
    """A JSON-able dict of an observation/action node."""
    if node is None:
        return None
    if isinstance(node, Leaf):
        out = {"leaf": node.kind, "shape": list(node.shape), "dtype": str(node.dtype).removeprefix("torch.")}
        if node.kind == "box":
            out.update(low=_bound_out(node.low), high=_bound_out(node.high))
        elif node.kind == "discrete":
            out.update(n=node.n, start=node.start)
        elif node.kind == "multi_discrete":
            out.update(nvec=list(node.nvec))
        else:
            out.update(n=node.n)
        if node.eval_only:
            out["eval_only"] = True
        return out
    out = {"dict": {k: node_to_dict(c) for k, c in node.children.items()}}
    if not node.atomic:
        out["atomic"] = False
    if node.conditional:
        out["conditional"] = dict(node.conditional)
    return out


def node_from_dict(data: dict[str, Any] | None, path: str = "") -> Node | None:
    """Inverse of :func:`node_to_dict`; errors name the path."""
    if data is None:
        return None
    if "dict" in data:
        return DictNode({k: node_from_dict(c, f"{path}/{k}") for k, c in data["dict"].items()},
                        atomic=bool(data.get("atomic", True)), conditional=data.get("conditional"))
    if data.get("dtype") not in _DTYPES:
        raise TreeError(path, f"unknown dtype {data.get('dtype')!r}")
    try:
        return Leaf(kind=data["leaf"], shape=tuple(data["shape"]), dtype=_DTYPES[data["dtype"]],
                    low=_bound_in(data.get("low", "-inf")), high=_bound_in(data.get("high", "inf")),
                    n=int(data.get("n", 0)), start=int(data.get("start", 0)),
                    nvec=tuple(data.get("nvec", ())), eval_only=bool(data.get("eval_only", False)))
    except (KeyError, TypeError) as err:
        raise TreeError(path, f"malformed leaf: {err}") from None


def tree_to_dict(tree: Tree) -> dict[str, Any]:
    """A JSON-able dict of a whole tree."""
    if isinstance(tree, AgentNode):
        return {"agent": {"observation": node_to_dict(tree.observation), "action": node_to_dict(tree.action)}}
    if isinstance(tree, ArrayPopulation):
        return {"array": {"template": tree_to_dict(tree.template)["agent"], "capacity": tree.capacity,
                          "payoff": tree.payoff, "shared_observation": node_to_dict(tree.shared_observation)}}
    return {"population": {"members": {k: tree_to_dict(m) for k, m in tree.members.items()},
                           "payoff": tree.payoff, "shared_observation": node_to_dict(tree.shared_observation)}}


def tree_from_dict(data: dict[str, Any], path: str = "") -> Tree:
    """Inverse of :func:`tree_to_dict`."""
    if "agent" in data:
        a = data["agent"]
        return AgentNode(observation=node_from_dict(a["observation"], f"{path}/observation"),
                         action=node_from_dict(a["action"], f"{path}/action"))
    if "array" in data:
        a = data["array"]
        return ArrayPopulation(template=tree_from_dict({"agent": a["template"]}, f"{path}/template"),
                               capacity=int(a["capacity"]), payoff=a["payoff"],
                               shared_observation=node_from_dict(a.get("shared_observation")))
    if "population" in data:
        p = data["population"]
        return DictPopulation(members={k: tree_from_dict(m, f"{path}/{k}") for k, m in p["members"].items()},
                              payoff=p["payoff"], shared_observation=node_from_dict(p.get("shared_observation")))
    raise TreeError(path, f"not a tree node: keys {sorted(data)}")


def to_json(tree: Tree) -> str:
    """The tree as a JSON document."""
    return json.dumps({"format": FORMAT, "tree": tree_to_dict(tree)}, allow_nan=False)


def from_json(text: str) -> Tree:
    """Parses :func:`to_json` output; refuses documents of another format."""
    doc = json.loads(text)
    if doc.get("format") != FORMAT:
        raise TreeError("", f"expected format {FORMAT!r}, got {doc.get('format')!r}")
    return tree_from_dict(doc["tree"])


__all__ = ["FORMAT", "from_json", "node_from_dict", "node_to_dict", "to_json", "tree_from_dict", "tree_to_dict"]
