"""The observation/action tree of seed 002: leaves, dict nodes, agents and populations.

Values only: every node is a frozen dataclass, checked at construction, with a message that names the
path of what is wrong. Functions over the tree live in the sibling modules.

A tree reads top-down::

    DictPopulation(members={"predator": ArrayPopulation(template=AgentNode(...), capacity=3),
                            "prey": AgentNode(observation=Leaf.box((4,)), action=Leaf.discrete(5))},
                   payoff="zero_sum", shared_observation=Leaf.box((12,), eval_only=True))

Leaves describe one tensor *without* batch dims; their torchrl counterpart comes from
:func:`core.specs.tensors.leaf_to_torchrl`.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Literal, Mapping, Union

import torch

LeafKind = Literal["box", "discrete", "multi_discrete", "binary"]
Payoff = Literal["cooperative", "zero_sum", "general"]
PAYOFFS: tuple[str, ...] = ("cooperative", "zero_sum", "general")

_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


class TreeError(ValueError):
    """An invalid tree; ``path`` names the node at fault (``"predator/observation/pos"``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path or '<root>'}: {message}")
        self.path = path


def _check_name(path: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise TreeError(path, f"name {name!r} must be a non-empty string of letters, digits, '_' or '-'")


def _whole(value, what: str) -> int:
    """``value`` as an int; a TreeError when it is no whole number (``Leaf.discrete(2.7)`` became 2 choices)."""
    if isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer()):
        return int(value)
    raise TreeError("", f"{what} must be a whole number, got {value!r}")


def _as_bound(value, shape: tuple[int, ...], path: str, what: str) -> float | tuple[float, ...]:
    """Normalises a scalar or per-element bound to a float or a flat tuple (row-major) of floats."""
    flat = (float(value),) if isinstance(value, (int, float)) else tuple(
        float(v) for v in torch.as_tensor(value, dtype=torch.float64).flatten().tolist())
    if any(math.isnan(v) for v in flat):
        raise TreeError(path, f"{what} holds NaN: a bound is a number, or +-inf for none")
    if isinstance(value, (int, float)):
        return flat[0]
    if len(flat) != math.prod(shape):
        raise TreeError(path, f"{what} has {len(flat)} elements, shape {shape} needs {math.prod(shape)}")
    return flat[0] if len(set(flat)) == 1 else flat


@dataclass(frozen=True, slots=True)
class Leaf:
    """One tensor slot of an observation or action; ``shape`` excludes batch dims.

    Build leaves with the constructors :meth:`box`, :meth:`discrete`, :meth:`multi_discrete`, :meth:`binary`.
    """

    kind: LeafKind
    """Box (continuous or integer array), discrete (one integer), multi_discrete or binary."""
    shape: tuple[int, ...]
    """Shape of one sample, without batch dims."""
    dtype: torch.dtype
    """Element dtype."""
    low: float | tuple[float, ...] = -math.inf
    """Lower bound (box): a scalar or one value per element, row-major."""
    high: float | tuple[float, ...] = math.inf
    """Upper bound (box), like ``low``."""
    n: int = 0
    """Number of choices (discrete) or of bits (binary)."""
    start: int = 0
    """Smallest value of a discrete leaf (gymnasium's ``Discrete(n, start)``)."""
    nvec: tuple[int, ...] = ()
    """Choices per component (multi_discrete)."""
    eval_only: bool = False
    """Observation tag: fed to training-time modules (a centralised critic), never to the deployed policy."""

    def __post_init__(self) -> None:
        self.check("")

    @staticmethod
    def box(shape, low=-math.inf, high=math.inf, dtype=torch.float32, eval_only=False) -> "Leaf":
        shape = tuple(_whole(s, "a box's shape") for s in shape)
        return Leaf("box", shape, dtype, _as_bound(low, shape, "", "low"), _as_bound(high, shape, "", "high"),
                    eval_only=eval_only)

    @staticmethod
    def discrete(n: int, start: int = 0, dtype=torch.int64, eval_only=False) -> "Leaf":
        return Leaf("discrete", (), dtype, n=_whole(n, "n"), start=_whole(start, "start"), eval_only=eval_only)

    @staticmethod
    def multi_discrete(nvec, dtype=torch.int64, eval_only=False) -> "Leaf":
        nvec = tuple(_whole(v, "nvec") for v in nvec)
        return Leaf("multi_discrete", (len(nvec),), dtype, nvec=nvec, eval_only=eval_only)

    @staticmethod
    def binary(n: int, dtype=torch.int8, eval_only=False) -> "Leaf":
        n = _whole(n, "n")
        return Leaf("binary", (n,), dtype, n=n, eval_only=eval_only)

    def check(self, path: str) -> None:
        """Raises :class:`TreeError` naming ``path`` when the leaf is inconsistent."""
        if self.kind not in ("box", "discrete", "multi_discrete", "binary"):
            raise TreeError(path, f"unknown leaf kind {self.kind!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TreeError(path, f"dtype must be a torch.dtype, got {self.dtype!r}")
        if any((not isinstance(s, int)) or s < 0 for s in self.shape):
            raise TreeError(path, f"shape {self.shape} must be non-negative integers")
        if self.kind == "box":
            low, high = _as_bound(self.low, self.shape, path, "low"), _as_bound(self.high, self.shape, path, "high")
            lows = low if isinstance(low, tuple) else (low,) * math.prod(self.shape)
            highs = high if isinstance(high, tuple) else (high,) * math.prod(self.shape)
            if any(lo > hi for lo, hi in zip(lows, highs)):
                raise TreeError(path, "box low exceeds high")
        elif self.kind == "discrete":
            if self.n < 1 or self.shape != ():
                raise TreeError(path, f"discrete leaf needs n >= 1 and shape (), got n={self.n}, shape={self.shape}")
        elif self.kind == "multi_discrete":
            if not self.nvec or min(self.nvec) < 1 or self.shape != (len(self.nvec),):
                raise TreeError(path, f"multi_discrete needs nvec >= 1 and shape (len(nvec),), got {self.nvec}")
        elif self.kind == "binary" and (self.n < 1 or self.shape != (self.n,)):
            raise TreeError(path, f"binary leaf needs n >= 1 and shape (n,), got n={self.n}, shape={self.shape}")
        if self.kind != "box" and (self.dtype.is_floating_point or self.dtype.is_complex):
            raise TreeError(path, f"{self.kind} leaf needs an integer or bool dtype, got {self.dtype}")
        if self.kind in ("discrete", "multi_discrete") and self.dtype != torch.bool:
            top = (self.start + self.n - 1) if self.kind == "discrete" else max(self.nvec) - 1
            if top > torch.iinfo(self.dtype).max or (self.start < torch.iinfo(self.dtype).min):
                wide = next((d for d in (torch.int16, torch.int32, torch.int64) if torch.iinfo(d).max >= top), None)
                fix = f"give dtype={wide} (or wider)" if wide else "no integer dtype holds them: use fewer values"
                raise TreeError(path, f"{self.kind} leaf's values reach {top}, past what {self.dtype} holds "
                                      f"({torch.iinfo(self.dtype).max}): {fix}")


class StructuredActionError(TreeError):
    """An action structure Shoal cannot act on (e.g. a leaf conditioned on a box leaf); ``path`` names the leaf,
    the message the nearest valid choice."""


@dataclass(frozen=True, slots=True)
class DictNode:
    """Fixed, named children (a gymnasium ``Dict``; a ``Tuple`` becomes children ``"0"``, ``"1"``, ...).

    Two action tags (:mod:`core.specs.structure`):

    - ``atomic=False``: each child is an *element* the env may execute or skip at a step; it says which, per
      agent and step, in ``(group, "action_mask", "@present", *element)`` ``[*B, A]`` bool, and the log-prob and
      entropy count only the elements executed.
    - ``conditional={"transform": "node"}``: discrete child ``transform`` is drawn after, and given, the earlier
      discrete sibling ``node`` (an autoregressive head); its legal values per value of ``node`` come as a
      table ``(group, "action_mask", "transform")`` ``[*B, A, n_node, n_transform]`` bool.
    """

    children: Mapping[str, "Node"]
    """The children, in order."""
    atomic: bool = True
    """Action tag: ``False`` means the parts of this action may execute separately (seed 002)."""
    conditional: Mapping[str, str] | None = None
    """Action tag: child name -> name of the earlier discrete sibling it is conditioned on (both discrete)."""

    def __post_init__(self) -> None:
        # A private plain-dict copy: picklable (Ray ships trees), and the caller's dict can't change it.
        object.__setattr__(self, "children", dict(self.children))
        object.__setattr__(self, "conditional", dict(self.conditional or {}))

    def __hash__(self) -> int:
        return hash((tuple(self.children.items()), self.atomic, tuple(self.conditional.items())))

    def __eq__(self, other) -> bool:
        return (isinstance(other, DictNode) and self.atomic == other.atomic
                and self.conditional == other.conditional
                and list(self.children.items()) == list(other.children.items()))


Node = Union[Leaf, DictNode]


def check_node(node: Node, path: str, *, role: Literal["observation", "action"]) -> None:
    """Checks an observation or action node recursively; errors name the path."""
    if isinstance(node, Leaf):
        node.check(path)
        if role == "action" and node.eval_only:
            raise TreeError(path, "eval_only is an observation tag; an action leaf cannot carry it")
    elif isinstance(node, DictNode):
        if not node.children:
            raise TreeError(path, "a dict node needs at least one child")
        if role == "observation" and not node.atomic:
            raise TreeError(path, "atomic=False is an action tag; observation nodes cannot carry it")
        if role == "observation" and node.conditional:
            raise TreeError(path, "conditional is an action tag; observation nodes cannot carry it")
        for name, child in node.children.items():
            _check_name(path, name)
            check_node(child, f"{path}/{name}", role=role)
        _check_conditional(node, path)
    else:
        raise TreeError(path, f"expected a Leaf or DictNode, got {type(node).__name__}")


def _check_conditional(node: DictNode, path: str) -> None:
    """Each conditioned child and what it is conditioned on: discrete leaves, the condition earlier in order."""
    names = list(node.children)
    for name, given in node.conditional.items():
        where = f"{path}/{name}"
        discrete = [k for k in names if k != name and isinstance(node.children[k], Leaf)
                    and node.children[k].kind == "discrete"]
        before = [k for k in discrete if names.index(k) < names.index(name)] if name in names else discrete
        hint = (f"condition it on a discrete sibling that comes before it: {before}" if before else
                "put a discrete leaf before it in the same dict to condition it on")
        if name not in node.children:
            raise StructuredActionError(where, f"conditional names no child of this dict (children: {names})")
        child = node.children[name]
        if not (isinstance(child, Leaf) and child.kind == "discrete"):
            kind = child.kind if isinstance(child, Leaf) else "dict"
            raise StructuredActionError(where, f"only a discrete leaf can be conditioned, this is a {kind} node; "
                                               "make it Leaf.discrete, or drop it from conditional")
        if given not in node.children:
            raise StructuredActionError(where, f"is conditioned on {given!r}, not a sibling; {hint}")
        target = node.children[given]
        if not (isinstance(target, Leaf) and target.kind == "discrete"):
            kind = target.kind if isinstance(target, Leaf) else "dict"
            raise StructuredActionError(where, f"is conditioned on {path}/{given}, a {kind} node (only a discrete "
                                               f"leaf can condition another); {hint}")
        if names.index(given) >= names.index(name):
            raise StructuredActionError(where, f"is conditioned on {path}/{given}, which does not come before it "
                                               f"(sampling follows the children's order); {hint}")


@dataclass(frozen=True, slots=True)
class AgentNode:
    """One agent (or the template of repeated agents): what it observes and how it acts."""

    observation: Node
    """Observation tree of the agent (without batch dims)."""
    action: Node
    """Action tree of the agent."""

    def __post_init__(self) -> None:
        check_node(self.observation, "observation", role="observation")
        check_node(self.action, "action", role="action")


@dataclass(frozen=True, slots=True)
class ArrayPopulation:
    """Seed 002's "Array": a variable number of identical agents, at most ``capacity`` at once."""

    template: AgentNode
    """What every member observes and does."""
    capacity: int
    """The largest number of members present at once (the agent dim of the group)."""
    payoff: Payoff = "cooperative"
    """How members' rewards relate: cooperative, zero_sum or general-sum."""
    shared_observation: Node | None = None
    """Observation common to the population (e.g. a global state), stored once per env."""

    def __post_init__(self) -> None:
        if not isinstance(self.template, AgentNode):
            raise TreeError("template", f"expected an AgentNode, got {type(self.template).__name__}")
        if not isinstance(self.capacity, int) or self.capacity < 1:
            raise TreeError("capacity", f"must be a positive int, got {self.capacity!r}")
        _check_population_meta(self.payoff, self.shared_observation, "")


@dataclass(frozen=True, slots=True)
class DictPopulation:
    """Seed 002's "Dictionary": fixed, uniquely named members (agents or sub-populations)."""

    members: Mapping[str, Union[AgentNode, ArrayPopulation, "DictPopulation"]]
    """The members, in order; names are unique by construction (a mapping)."""
    payoff: Payoff = "general"
    """How members' rewards relate: cooperative, zero_sum or general-sum."""
    shared_observation: Node | None = None
    """Observation common to the population (e.g. ``state()`` of a PettingZoo env), stored once per env."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", dict(self.members))
        if not self.members:
            raise TreeError("", "a dict population needs at least one member")
        for name, member in self.members.items():
            _check_name("", name)
            if not isinstance(member, (AgentNode, ArrayPopulation, DictPopulation)):
                raise TreeError(name, f"a member must be an AgentNode or a population, got {type(member).__name__}")
        _check_population_meta(self.payoff, self.shared_observation, "")

    def __hash__(self) -> int:
        return hash((tuple(self.members.items()), self.payoff, self.shared_observation))

    def __eq__(self, other) -> bool:
        return (isinstance(other, DictPopulation) and self.payoff == other.payoff
                and self.shared_observation == other.shared_observation
                and list(self.members.items()) == list(other.members.items()))


Population = Union[ArrayPopulation, DictPopulation]
Tree = Union[AgentNode, ArrayPopulation, DictPopulation]


def _check_population_meta(payoff: str, shared: Node | None, path: str) -> None:
    if payoff not in PAYOFFS:
        raise TreeError(f"{path}payoff", f"must be one of {PAYOFFS}, got {payoff!r}")
    if shared is not None:
        check_node(shared, f"{path}shared_observation", role="observation")


def iter_leaves(node: Node, prefix: tuple[str, ...] = ()):
    """Yields ``(key_path, leaf)`` for every leaf under ``node``; a bare leaf has the empty path."""
    if isinstance(node, Leaf):
        yield prefix, node
    else:
        for name, child in node.children.items():
            yield from iter_leaves(child, (*prefix, name))


def population(tree: Tree) -> Population:
    """Wraps a single :class:`AgentNode` as a one-member population (a single-agent env)."""
    if isinstance(tree, AgentNode):
        return DictPopulation(members={"agent": tree}, payoff="general")
    return tree


__all__ = [
    "AgentNode", "ArrayPopulation", "DictNode", "DictPopulation", "Leaf", "LeafKind", "Node", "Payoff",
    "Population", "StructuredActionError", "Tree", "TreeError", "check_node", "iter_leaves", "population",
]
