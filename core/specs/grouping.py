"""From a tree to the tensor layout: which agents share a group, and the default policy mapping.

A group stacks agents with identical :class:`AgentNode` s along an agent dim, so one forward pass serves
all of them (``td[group]`` has batch ``[env, time, agent]``):

- an :class:`ArrayPopulation` is one group of ``capacity`` slots named after its path;
- the plain agents of a :class:`DictPopulation` are grouped by name prefix (``"adversary_0"``,
  ``"adversary_1"`` -> group ``"adversary"``) and by identical spaces, so heterogeneous teams (mpe2
  simple_tag) land in different groups; agents of one prefix with different spaces get ``prefix_1``, ...
- nested populations prefix their groups with their member name and ``"/"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .nodes import AgentNode, ArrayPopulation, DictPopulation, Node, Payoff, Tree, TreeError, population

_TRAILING_INDEX = re.compile(r"^(.*?)[_\-]?(\d+)$")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group of the tensor layout."""

    name: str
    """Key of the group in step and fragment TensorDicts."""
    agent: AgentNode
    """The spaces every member of the group shares."""
    agent_names: tuple[str, ...]
    """One name per slot of the agent dim (``len == capacity``)."""
    population_path: str
    """Path of the population the group belongs to (``""`` for the root)."""
    payoff: Payoff
    """Payoff of that population."""
    is_array: bool
    """True when the group is an :class:`ArrayPopulation` (members come and go); False for named agents."""

    @property
    def capacity(self) -> int:
        """Size of the agent dim."""
        return len(self.agent_names)


def _prefix(name: str) -> str:
    match = _TRAILING_INDEX.match(name)
    return match.group(1) if match and match.group(1) else name


def groups(tree: Tree) -> dict[str, GroupSpec]:
    """The groups of ``tree`` in a stable order (members in declaration order).

    Raises:
        TreeError: when two groups would get the same name, a group the name of a key of the layout
            (:data:`core.layout.RESERVED_ROOT_KEYS`), or two agents of different groups the same name (agents are
            named, and mapped to policies, by their names alone).
    """
    out: dict[str, GroupSpec] = {}
    _collect(population(tree), "", out)
    seen: dict[str, str] = {}
    for spec in out.values():
        for agent in spec.agent_names:
            if seen.setdefault(agent, spec.name) != spec.name:
                raise TreeError(f"{spec.population_path or '<root>'}/{agent}", f"agent name {agent!r} is also in "
                                f"group {seen[agent]!r}: agents are named, and mapped to policies, by their names "
                                f"alone; rename one (e.g. {spec.name.replace('/', '_')!r})")
    return out


def _add(out: dict[str, GroupSpec], spec: GroupSpec) -> None:
    from core.layout import RESERVED_ROOT_KEYS

    if spec.name in out:
        raise TreeError(spec.name, "two groups get this name; rename a member")
    if spec.name in RESERVED_ROOT_KEYS:
        raise TreeError(spec.name, f"a group of this name would take a key of Shoal's layout (reserved: "
                        f"{sorted(RESERVED_ROOT_KEYS)}); rename the agent or member")
    out[spec.name] = spec


def _collect(pop, path: str, out: dict[str, GroupSpec]) -> None:
    prefix = f"{path}/" if path else ""
    if isinstance(pop, ArrayPopulation):
        name = path or "agents"
        _add(out, GroupSpec(name, pop.template, tuple(f"{name}_{i}" for i in range(pop.capacity)),
                            path, pop.payoff, True))
        return
    # Named agents join the group of their prefix and spaces; groups keep the order of first appearance.
    order: list = []
    pending: dict[tuple[str, AgentNode], list[str]] = {}
    for member_name, member in pop.members.items():
        if isinstance(member, AgentNode):
            key = (_prefix(member_name), member)
            if key not in pending:
                pending[key] = []
                order.append(key)
            pending[key].append(member_name)
        else:
            order.append((member_name, member))
    used: dict[str, int] = {}
    for key in order:
        if key not in pending:
            _collect(key[1], prefix + key[0], out)
            continue
        stem, agent = key
        k = used.get(stem, 0)
        used[stem] = k + 1
        name = prefix + (stem if k == 0 else f"{stem}_{k}")
        _add(out, GroupSpec(name, agent, tuple(pending[key]), path, pop.payoff, False))


def shared_observations(tree: Tree) -> dict[tuple[str, ...], Node]:
    """Shared observation nodes by key path under ``"shared"`` (root population: the empty path)."""
    out: dict[tuple[str, ...], Node] = {}

    def visit(pop, path: tuple[str, ...]) -> None:
        if pop.shared_observation is not None:
            out[path] = pop.shared_observation
        if isinstance(pop, DictPopulation):
            for name, member in pop.members.items():
                if not isinstance(member, AgentNode):
                    visit(member, (*path, name))

    visit(population(tree), ())
    return out


def agent_index(tree: Tree) -> dict[str, tuple[str, int]]:
    """Maps every agent name to ``(group, slot)`` in the tensor layout."""
    return {agent: (g.name, i) for g in groups(tree).values() for i, agent in enumerate(g.agent_names)}


def default_policy_mapping(tree: Tree) -> dict[str, str]:
    """Agent name -> policy id, derived from the tree: agents of one group share one policy.

    Config may override it (e.g. one policy per named agent); the structure comes from the environment.
    """
    return {agent: group for agent, (group, _) in agent_index(tree).items()}


__all__ = ["GroupSpec", "agent_index", "default_policy_mapping", "groups", "shared_observations"]
