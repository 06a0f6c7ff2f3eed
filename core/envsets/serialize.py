"""A JSON form of an environment collection declaration, lossless, for config files.

Plain JSON only (no pickle, no eval). A document carries ``"format": "shoal.envcollection/1"``::

    {"format": "shoal.envcollection/1",
     "members": {"easy": {"env": "Maze-v0", "kwargs": {"size": 5}}, "hard": "Maze-v1"},
     "structure": {"kind": "curriculum", "stages": ["easy", "hard"], "edges": [["easy", "hard"]],
                   "metric": "mean_return", "threshold": 0.9}}

A member is ``{"env": name, "kwargs": {...}}`` or just the env name. Structures: ``{"kind": "split", "train",
"test"}``, ``{"kind": "curriculum", "stages", "edges"?, "metric", "threshold", "require"?}``,
``{"kind": "adversarial", "ids", "temperature"?, "metric"?}``, ``{"kind": "prior", "id", "params": {name:
dist}}`` with ``dist`` one of ``{"kind": "uniform", "low", "high"}``, ``{"kind": "normal", "mean", "std",
"clip"?}``, ``{"kind": "choice", "values", "probs"?}``; ``?`` marks optional fields. Unknown fields and kinds
are refused with the nearest valid name.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any, Mapping

from .adversarial import AdversarialSet
from .collection import EnvCollection, EnvMember, member_from
from .curriculum import Curriculum
from .ids import CollectionError, hint
from .priors import Choice, Normal, PriorDistribution, Uniform
from .split import Split

FORMAT = "shoal.envcollection/1"
STRUCTURE_KINDS: dict[str, type] = {"split": Split, "curriculum": Curriculum, "adversarial": AdversarialSet,
                                    "prior": PriorDistribution}
DISTRIBUTION_KINDS: dict[str, type] = {"uniform": Uniform, "normal": Normal, "choice": Choice}


def _kind_of(value: object, kinds: Mapping[str, type]) -> str:
    return next(k for k, cls in kinds.items() if type(value) is cls)


def _plain(value: Any) -> Any:
    """Tuples and read-only mappings back to JSON lists and objects."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _record(value: object, kinds: Mapping[str, type]) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": _kind_of(value, kinds)}
    for f in fields(value):  # type: ignore[arg-type]
        item = getattr(value, f.name)
        if f.name == "params":
            out[f.name] = {name: _record(dist, DISTRIBUTION_KINDS) for name, dist in item.items()}
        else:
            out[f.name] = _plain(item)
    return out


def collection_to_dict(collection: EnvCollection) -> dict[str, Any]:
    """A JSON-able dict of the declaration."""
    members = {}
    for env_id, member in collection.members.items():
        members[env_id] = {"env": member.env, "kwargs": _plain(member.kwargs)} if member.kwargs else member.env
    structure = None if collection.structure is None else _record(collection.structure, STRUCTURE_KINDS)
    return {"format": FORMAT, "members": members, "structure": structure}


def _object(data: object, where: str, cls: type) -> dict[str, Any]:
    """``data`` checked against the fields of ``cls`` (plus ``kind``): unknown or missing names are errors."""
    if not isinstance(data, dict):
        raise CollectionError(where, f"expected a JSON object, got {data!r}")
    names = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    for key in data:
        if key != "kind" and key not in names:
            raise CollectionError(f"{where}.{key}", f"unknown field {key!r} of {cls.__name__}{hint(key, names)}")
    for key in required:
        if key not in data:
            raise CollectionError(where, f"{cls.__name__} needs the field {key!r}")
    return {k: v for k, v in data.items() if k != "kind"}


def _kind(data: object, where: str, kinds: Mapping[str, type]) -> type:
    if not isinstance(data, dict):
        raise CollectionError(where, f"expected a JSON object with a 'kind', got {data!r}")
    kind = data.get("kind")
    if kind not in kinds:
        raise CollectionError(f"{where}.kind", f"unknown kind {kind!r}{hint(kind, kinds)}")
    return kinds[kind]


def structure_from_dict(data: object, where: str = "structure") -> Any:
    """A structure from its JSON object (``None`` stays ``None``)."""
    if data is None:
        return None
    cls = _kind(data, where, STRUCTURE_KINDS)
    kwargs = _object(data, where, cls)
    if cls is PriorDistribution and isinstance(kwargs.get("params"), dict):
        kwargs["params"] = {name: _distribution(d, f"{where}.params.{name}") for name, d in kwargs["params"].items()}
    return cls(**kwargs)


def _distribution(data: object, where: str) -> Any:
    cls = _kind(data, where, DISTRIBUTION_KINDS)
    return cls(**_object(data, where, cls))


def _member(data: object, where: str) -> EnvMember | str:
    if isinstance(data, str):
        return data
    return member_from(where.removeprefix("members."), **_object(data, where, EnvMember))


def collection_from_dict(data: object) -> EnvCollection:
    """Inverse of :func:`collection_to_dict`; refuses another format, unknown fields and unknown kinds."""
    if not isinstance(data, dict):
        raise CollectionError("<document>", f"expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise CollectionError("format", f"expected {FORMAT!r}, got {data.get('format')!r}")
    for key in data:
        if key not in ("format", "members", "structure"):
            raise CollectionError(key, f"unknown field {key!r}{hint(key, ('format', 'members', 'structure'))}")
    members = data.get("members")
    if not isinstance(members, dict):
        raise CollectionError("members", f"expected a JSON object env id -> env, got {members!r}")
    return EnvCollection(members={k: _member(m, f"members.{k}") for k, m in members.items()},
                         structure=structure_from_dict(data.get("structure")))


def to_json(collection: EnvCollection, indent: int | None = None) -> str:
    """The declaration as a JSON document."""
    return json.dumps(collection_to_dict(collection), allow_nan=False, indent=indent)


def from_json(text: str) -> EnvCollection:
    """Parses a JSON document (:func:`to_json` output or a config file)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise CollectionError("<document>", f"not JSON: {err}") from None
    return collection_from_dict(data)


__all__ = ["DISTRIBUTION_KINDS", "FORMAT", "STRUCTURE_KINDS", "collection_from_dict", "collection_to_dict",
           "from_json", "structure_from_dict", "to_json"]
