"""Which policy acts for which agent slot: the agent -> policy mapping resolved onto the group layout.

The default mapping comes from the tree (one policy per group, :func:`core.specs.default_policy_mapping`);
a config may override it per agent, e.g. ``player_1`` -> a random policy while ``player_0`` learns. When the
agents of one group are split between policies, each policy runs on the whole group (one batched forward)
and its outputs are kept on its own slots; a learner trains only on its slots (the mask is narrowed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

import torch

from core.envsets.ids import nearest
from core.specs import Tree, default_policy_mapping, groups


@dataclass(frozen=True)
class GroupAssignment:
    """The policies acting in one group."""

    group: str
    """The group."""
    policies: tuple[str, ...]
    """Policy ids in first-slot order."""
    slots: dict[str, torch.Tensor]
    """Policy id -> bool ``[A]`` of the slots it acts for."""

    @property
    def single(self) -> str | None:
        """The policy id when one policy acts for every slot, else None."""
        return self.policies[0] if len(self.policies) == 1 else None

    @property
    def main_policy(self) -> str:
        """The policy with the most slots (first on ties): its version labels the group's data."""
        return max(self.policies, key=lambda p: (int(self.slots[p].sum()), -self.policies.index(p)))


def assign(tree: Tree, overrides: Mapping[str, str] | None = None,
           per_group: Collection[str] = ()) -> dict[str, GroupAssignment]:
    """Group -> :class:`GroupAssignment` from the default mapping updated with ``overrides`` (agent -> policy).

    A policy id in ``per_group`` (fixed policies: ``random``, scripted, frozen) that acts in several groups
    whose spaces differ gets one module per group: it becomes ``"<id>@<group>"`` in each of them (a random
    speaker and a random listener cannot share one network).

    Raises:
        KeyError: naming an override for an agent the tree does not have, and the nearest agent names.
    """
    mapping = default_policy_mapping(tree)
    unknown = sorted(set(overrides or {}) - set(mapping))
    if unknown:
        near = {a: nearest(a, mapping) for a in unknown}
        named = ", ".join(f"{a!r}" + (f" (did you mean {' or '.join(map(repr, n))}?)" if n else "")
                          for a, n in near.items())
        raise KeyError(f"policy mapping names agents the environment does not have: {named}; its agents are "
                       f"{sorted(mapping)}")
    mapping.update(overrides or {})
    specs = groups(tree)
    for pid in set(per_group):
        acting = [g for g, spec in specs.items() if any(mapping[a] == pid for a in spec.agent_names)]
        if len({specs[g].agent for g in acting}) > 1:
            for g in acting:
                for a in specs[g].agent_names:
                    if mapping[a] == pid:
                        mapping[a] = f"{pid}@{g}"
    out = {}
    for name, spec in groups(tree).items():
        pids = list(dict.fromkeys(mapping[a] for a in spec.agent_names))
        slots = {p: torch.tensor([mapping[a] == p for a in spec.agent_names]) for p in pids}
        out[name] = GroupAssignment(name, tuple(pids), slots)
    return out


def groups_of(assignment: Mapping[str, GroupAssignment], policy_id: str) -> dict[str, torch.Tensor | None]:
    """Group -> slot mask (None: every slot) of the groups where ``policy_id`` acts."""
    return {g: (None if a.single == policy_id else a.slots[policy_id])
            for g, a in assignment.items() if policy_id in a.policies}


__all__ = ["GroupAssignment", "assign", "groups_of"]
