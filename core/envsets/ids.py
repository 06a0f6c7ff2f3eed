"""Env ids: the error every collection raises, id checks with nearest-spelling hints, and uniform draws.

An env id is a non-empty string of letters, digits, ``_``, ``-`` or ``.`` (``"cartpole"``, ``"maze-5x5"``):
it ends up in metric names (``env/<id>/mean_return``), so it holds no ``/`` and no spaces.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Iterable, Mapping, Sequence

import torch

_ID = re.compile(r"^[A-Za-z0-9_.\-]+$")
_LISTED = 8  # valid choices listed in a message when none is close


class CollectionError(ValueError):
    """An invalid collection declaration or call; ``where`` names the field at fault (``"curriculum.edges[1]"``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where


def nearest(name: object, choices: Iterable[str]) -> list[str]:
    """The nearest of ``choices`` to ``name`` (difflib's ratio, 0.6 at least) with those exactly as near
    (``player_1`` and ``player_2`` for ``player_0``), in the choices' order; ``[]`` when none is near, or when more
    than three are as near (``agent_9`` among ``agents_0..7``: no one of them is the nearest)."""
    ratios = {c: difflib.SequenceMatcher(None, str(name), c).ratio() for c in dict.fromkeys(map(str, choices))}
    best = max(ratios.values(), default=0.0)
    tied = [c for c, r in ratios.items() if r == best] if best >= 0.6 else []
    return tied if len(tied) <= 3 else []


def hint(name: object, choices: Iterable[str], close_as: str = "did you mean {}?", rest_as: str = "valid: {}") -> str:
    """A suffix for an error message: the nearest of ``choices`` (difflib), else the choices themselves.

    Returns ``" (did you mean 'cartpole'?)"``, ``" (valid: 'a', 'b')"`` or ``""`` when there are no choices;
    ``close_as`` and ``rest_as`` reword the two forms.
    """
    choices = list(dict.fromkeys(str(c) for c in choices))
    if close := nearest(name, choices):
        return f" ({close_as.format(' or '.join(map(repr, close)))})"
    if not choices:
        return ""
    more = ", ..." if len(choices) > _LISTED else ""
    return f" ({rest_as.format(', '.join(repr(c) for c in choices[:_LISTED]) + more)})"


def check_id(env_id: object, where: str, what: str = "env id") -> str:
    """Returns ``env_id`` when it is a valid id (see the module docstring), else raises :class:`CollectionError`."""
    if not isinstance(env_id, str) or not _ID.match(env_id):
        raise CollectionError(where, f"{what} {env_id!r} must be a non-empty string of letters, digits, "
                                     "'_', '-' or '.'")
    return env_id


def check_ids(ids: object, where: str) -> tuple[str, ...]:
    """A non-empty tuple of distinct valid env ids from a sequence; errors name the entry at fault."""
    if isinstance(ids, str) or not isinstance(ids, Sequence):
        raise CollectionError(where, f"expected a list of env ids, got {ids!r}")
    if not ids:
        raise CollectionError(where, "needs at least one env id")
    seen: set[str] = set()
    for k, env_id in enumerate(ids):
        check_id(env_id, f"{where}[{k}]")
        if env_id in seen:
            raise CollectionError(f"{where}[{k}]", f"env id {env_id!r} is listed twice")
        seen.add(env_id)
    return tuple(ids)


def check_known(env_id: object, known: Sequence[str], where: str, what: str = "unknown env id") -> str:
    """Returns ``env_id`` when it is one of ``known``; else an error naming it and the nearest known id."""
    if env_id not in known:
        raise CollectionError(where, f"{what} {env_id!r}{hint(env_id, known)}")
    return env_id  # type: ignore[return-value]


def missing_metric(env_id: str, metric: str, metrics: object, field: str) -> CollectionError:
    """The error for a report of ``env_id`` that lacks ``metric`` (the name configured in ``field``)."""
    names = list(metrics) if isinstance(metrics, Mapping) else []
    return CollectionError(f"metrics_by_env[{env_id!r}]", f"no metric {metric!r} ({field})" + hint(
        metric, names, close_as="closest reported: {}", rest_as="reported: {}"))


def check_metric_ids(metrics_by_env: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """Every key of ``metrics_by_env`` is one of ``known`` (an error names the first that is not)."""
    if not isinstance(metrics_by_env, Mapping):
        raise CollectionError(where, f"expected a mapping from env id to metrics, got {type(metrics_by_env).__name__}")
    for env_id in metrics_by_env:
        check_known(env_id, known, f"{where}[{env_id!r}]")


def check_finite(value: object, where: str) -> float:
    """``value`` as a finite float, else an error naming ``where``."""
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise CollectionError(where, f"expected a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(out):
        raise CollectionError(where, f"expected a finite number, got {value!r}")
    return out


def check_count(n: object) -> int:
    """``n`` as a number of draws (an int >= 0)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise CollectionError("n", f"number of draws must be an int >= 0, got {n!r}")
    return n


def draw_uniform(ids: Sequence[str], n: int, generator: torch.Generator) -> tuple[str, ...]:
    """``n`` ids drawn uniformly with replacement from ``ids`` (non-empty); deterministic given ``generator``."""
    if not ids:
        raise CollectionError("state", "no env id to draw from")
    picks = torch.randint(len(ids), (check_count(n),), generator=generator)
    return tuple(ids[k] for k in picks.tolist())


__all__ = ["CollectionError", "check_count", "check_finite", "check_id", "check_ids", "check_known",
           "check_metric_ids", "draw_uniform", "hint", "missing_metric", "nearest"]
