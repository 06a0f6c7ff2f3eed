"""Environment collections (seed 002): envs indexed by string ids, with a semantic structure when there are several.

The usage loop (orchestration runs it; every call here is pure and takes its randomness as a generator)::

    collection = EnvCollection.from_json(text)              # or built in code
    state = collection.initial_state()
    while training:
        env_ids = collection.draw(state, num_episodes, generator)   # the env of each new episode
        params = collection.sample_params(num_episodes, generator)  # prior draws; {} without a prior
        ...  # run the episodes, record the env id of every fragment, report metrics per env id
        state = collection.update(state, metrics_by_env)            # {env_id: {metric: value}}
    ...  # evaluate on collection.evaluation_ids()
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Protocol, Union

import torch

from .adversarial import AdversarialSet
from .curriculum import Curriculum
from .ids import CollectionError, check_count, check_id, check_known, check_metric_ids, hint
from .priors import PriorDistribution
from .split import Split

Structure = Union[Split, Curriculum, AdversarialSet, PriorDistribution]
STRUCTURES: tuple[type, ...] = (Split, Curriculum, AdversarialSet, PriorDistribution)


class StructureProtocol(Protocol):
    """What every structure offers; ``state`` is the structure's own value (None when it has none)."""

    @property
    def ids(self) -> tuple[str, ...]: ...
    def initial_state(self) -> Any: ...
    def training_ids(self, state: Any) -> tuple[str, ...]: ...
    def evaluation_ids(self) -> tuple[str, ...]: ...
    def draw(self, state: Any, n: int, generator: torch.Generator) -> tuple[str, ...]: ...
    def update(self, state: Any, metrics_by_env: Mapping[str, Mapping[str, Any]]) -> Any: ...


def freeze_json(value: Any, where: str) -> Any:
    """A JSON value made immutable (lists -> tuples, dicts -> read-only mappings); rejects anything else."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CollectionError(where, f"expected a finite number, got {value!r}")
        return value
    if isinstance(value, (list, tuple)):
        return tuple(freeze_json(v, f"{where}[{k}]") for k, v in enumerate(value))
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise CollectionError(where, f"keys must be strings, got {key!r}")
        return MappingProxyType({k: freeze_json(v, f"{where}.{k}") for k, v in value.items()})
    raise CollectionError(where, f"expected a JSON value (str, number, bool, None, list, dict), got "
                                 f"{type(value).__name__}")


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvMember:
    """How to build one env of a collection: a name orchestration resolves, and its constructor arguments."""

    env: str
    """The env as the entry points name it (e.g. ``"CartPole-v1"``); resolved outside core."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Constructor keyword arguments: JSON values only (str, number, bool, None, lists, dicts)."""

    def __post_init__(self) -> None:
        if not isinstance(self.env, str) or not self.env:
            raise CollectionError("member.env", f"expected a non-empty env name, got {self.env!r}")
        if not isinstance(self.kwargs, Mapping):
            raise CollectionError("member.kwargs", f"expected a mapping, got {self.kwargs!r}")
        object.__setattr__(self, "kwargs", freeze_json(self.kwargs, "member.kwargs"))


def _members(members: object) -> Mapping[str, EnvMember]:
    if not isinstance(members, Mapping) or not members:
        raise CollectionError("members", f"expected a non-empty mapping env id -> env, got {members!r}")
    out = {}
    for env_id, member in members.items():
        where = f"members[{env_id!r}]"
        check_id(env_id, where)
        if isinstance(member, str):
            member = member_from(env_id, env=member)
        if not isinstance(member, EnvMember):
            raise CollectionError(where, f"expected an env name or EnvMember, got {member!r}")
        out[env_id] = member
    return MappingProxyType(out)


def member_from(env_id: str, **fields: Any) -> EnvMember:
    """``EnvMember(**fields)``, its errors naming the member: ``members['maze'].env`` rather than ``member.env``."""
    try:
        return EnvMember(**fields)
    except CollectionError as err:
        where = f"members[{env_id!r}]{err.where.removeprefix('member')}"
        raise CollectionError(where, str(err).removeprefix(f"{err.where}: ")) from None


def _structure_names() -> str:
    return ", ".join(s.__name__ for s in STRUCTURES)


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvCollection:
    """Envs by id plus the structure that says which to train on, which to evaluate on, and how to pick.

    One env needs no structure. Several need one, and then every member belongs to the structure and every
    env id of the structure is a member.
    """

    members: Mapping[str, EnvMember]
    """Env id -> how to build it (an env name string is shorthand for ``EnvMember(env=name)``)."""
    structure: Structure | None = None
    """A :class:`Split`, :class:`Curriculum`, :class:`AdversarialSet` or :class:`PriorDistribution`; required
    when there is more than one member."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", _members(self.members))
        ids = tuple(self.members)
        if self.structure is None:
            if len(ids) > 1:
                raise CollectionError("structure", f"{len(ids)} envs ({', '.join(map(repr, ids))}) need a "
                                                   f"structure saying how to use them; one of: {_structure_names()}")
            return
        if not isinstance(self.structure, STRUCTURES):
            raise CollectionError("structure", f"expected one of {_structure_names()}, got "
                                               f"{type(self.structure).__name__}")
        kind = type(self.structure).__name__
        for env_id in self.structure.ids:
            if env_id not in ids:
                raise CollectionError(f"structure ({kind})", f"env id {env_id!r} is not a member{hint(env_id, ids)}")
        for env_id in ids:
            if env_id not in self.structure.ids:
                raise CollectionError(f"members[{env_id!r}]", f"env id {env_id!r} is not used by the {kind}; "
                                                              "add it there or remove the member")

    @property
    def ids(self) -> tuple[str, ...]:
        """Every env id, in declaration order."""
        return tuple(self.members)

    def initial_state(self) -> Any:
        """The structure's starting state (None without a structure, or for a split or a prior)."""
        return None if self.structure is None else self.structure.initial_state()

    def training_ids(self, state: Any = None) -> tuple[str, ...]:
        """The env ids training may draw in ``state``."""
        return self.ids if self.structure is None else self.structure.training_ids(state)

    def evaluation_ids(self) -> tuple[str, ...]:
        """The env ids evaluation runs on."""
        return self.ids if self.structure is None else self.structure.evaluation_ids()

    def draw(self, state: Any, n: int, generator: torch.Generator) -> tuple[str, ...]:
        """The env ids of ``n`` new training episodes; deterministic given ``generator``."""
        if self.structure is None:
            return self.ids * check_count(n)
        return self.structure.draw(state, n, generator)

    def update(self, state: Any, metrics_by_env: Mapping[str, Mapping[str, Any]]) -> Any:
        """The next state given ``{env_id: {metric: value}}`` (curriculum promotion, adversarial returns)."""
        check_metric_ids(metrics_by_env, self.ids, "metrics_by_env")
        return state if self.structure is None else self.structure.update(state, metrics_by_env)

    def sample_params(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Per-episode env parameters ``{name: [n]}`` from a :class:`PriorDistribution`; ``{}`` otherwise."""
        if isinstance(self.structure, PriorDistribution):
            return self.structure.sample(n, generator)
        check_count(n)
        return {}

    def member(self, env_id: str) -> EnvMember:
        """How to build ``env_id`` (an error names the nearest member)."""
        return self.members[check_known(env_id, self.ids, "env_id")]

    def to_json(self) -> str:
        """The declaration as a JSON document (see :mod:`core.envsets.serialize`)."""
        from .serialize import to_json  # serialize imports this module

        return to_json(self)

    @staticmethod
    def from_json(text: str) -> "EnvCollection":
        """Parses :meth:`to_json` output or a hand-written config document; never runs code."""
        from .serialize import from_json

        return from_json(text)


__all__ = ["STRUCTURES", "EnvCollection", "EnvMember", "Structure", "StructureProtocol", "freeze_json",
           "member_from"]
