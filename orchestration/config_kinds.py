"""What a config field's annotation allows, said in words, and a check of a whole config against its annotations.

Three readers share it: the config-file reader (``orchestration.sweeps``: YAML words), the ``--env-kwargs`` check
(``orchestration.envs``: Python words) and every orchestration config's ``__post_init__`` (:func:`check_fields`:
a Python caller's ``TrainConfig(iterations="10")`` or ``anneal_lr="no"`` is named before any value is read,
instead of failing later in a comparison or being taken as true). Imports nothing heavy (``shoal --help`` reads
configs without torch).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
import os
import types
import typing
from collections.abc import Mapping
from typing import Any


def allows(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of the annotated type (containers by kind only; anything not understood passes)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(allows(a, value) for a in args)
    if origin is typing.Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint in (bool, str):
        return isinstance(value, hint)
    if origin is tuple or hint is tuple:
        return isinstance(value, tuple)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    return True


YAML_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", type(None): "null",
              tuple: "a list"}
"""How :func:`describe` names the plain types for a config file."""
PYTHON_WORDS = {bool: "a bool", int: "an int", float: "a float", str: "a str", type(None): "None", tuple: "a tuple"}
"""How :func:`describe` names the plain types for a Python value (``--env-kwargs`` literals, config objects)."""


def describe(hint: Any, words: Mapping[Any, str] = YAML_WORDS) -> str:
    """An annotation in words (``words``: the plain types' names; a config file's by default)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a, words) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin is tuple or hint is tuple:
        return words[tuple]
    return words.get(hint, getattr(hint, "__name__", str(hint)))


@functools.cache
def field_hints(kind: type) -> dict[str, Any]:
    """The resolved field annotations of a config dataclass (empty where they cannot be: nothing is checked)."""
    try:
        return typing.get_type_hints(kind)
    except Exception:  # noqa: BLE001 - an annotation naming something not importable here: check nothing
        return {}


def check_fields(config: Any) -> None:
    """Check every field of the dataclass ``config`` against its annotation, as a Python caller gave it, each
    value first kept as :func:`as_field_value` says (lists as tuples, numpy scalars as Python's, ...), so that the
    frozen config stays hashable, writes as JSON and compares equal to one read from a file.

    Raises:
        TypeError: naming ``Class.field``, what it takes and what it got.
        ValueError: a ``Literal`` field given another value, with the nearest choice.
    """
    where = type(config).__name__
    for name, hint, plain, pairs in _plan(type(config)):
        value = getattr(config, name)
        if plain is not None and type(value) in plain:  # the common case, at the cost of one lookup
            continue
        if (kept := as_field_value(hint, value)) is not value:
            value = kept
            object.__setattr__(config, name, value)
        if pairs and isinstance(value, tuple) and not all(isinstance(p, tuple) and len(p) == 2 for p in value):
            raise TypeError(f"{where}.{name} takes (name, value) pairs, e.g. (('a', 'b'),), or a dict "
                            f"{{'a': 'b'}}; got {value!r}")
        if allows(hint, value):
            continue
        if typing.get_origin(hint) is typing.Literal and isinstance(value, str):
            choices = [c for c in typing.get_args(hint) if isinstance(c, str)]
            near = difflib.get_close_matches(value.lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
            hint_text = f" (did you mean {choices[[c.lower() for c in choices].index(near[0])]!r}?)" if near else ""
            raise ValueError(f"{where}.{name} must be {' or '.join(map(repr, choices))}, got {value!r}{hint_text}")
        got = "" if value is None else f" ({PYTHON_WORDS.get(type(value), f'a {type(value).__name__}')})"
        raise TypeError(f"{where}.{name} takes {describe(hint, PYTHON_WORDS)}, got {value!r}{got}")


def as_field_value(hint: Any, value: Any) -> Any:
    """``value`` as a field annotated ``hint`` keeps it (``value`` itself where nothing changes): a numpy scalar
    as the Python number or bool it holds (JSON writes it), a path or a ``torch.device`` given for a name as its
    text, a list for a tuple as a tuple (inner lists too), a mapping for ``(name, value)`` pairs as its items."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike) or type(value).__module__ == "torch" and type(value).__name__ == "device":
        return (os.fspath(value) if isinstance(value, os.PathLike) else str(value)) if allows(hint, "text") else value
    if _is_tuple(hint) and isinstance(value, Mapping) and _is_pairs(hint):
        return tuple(value.items())
    if _is_tuple(hint) and isinstance(value, list):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return value


_PLAIN = {int: (int,), float: (float, int), str: (str,), bool: (bool,)}


@functools.cache
def _plan(kind: type) -> tuple[tuple[str, Any, tuple[type, ...] | None, bool], ...]:
    """Per field of ``kind``: its name, annotation, the exact types it takes without a further check (plain
    annotations only), and whether it is a tuple of pairs."""
    return tuple((name, hint, _PLAIN.get(hint), _is_pairs(hint)) for name, hint in field_hints(kind).items())


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple or hint is tuple


def _is_pairs(hint: Any) -> bool:
    """``tuple[tuple[K, V], ...]``: a field of ``(name, value)`` pairs."""
    args = typing.get_args(hint)
    return bool(args) and _is_tuple(args[0]) and len(typing.get_args(args[0])) == 2


__all__ = ["PYTHON_WORDS", "YAML_WORDS", "allows", "as_field_value", "check_fields", "describe", "field_hints"]
