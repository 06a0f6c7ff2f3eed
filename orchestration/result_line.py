"""The JSON line a command prints as its result: strict JSON, which any parser reads.

Python's ``json.dumps`` writes a float NaN as ``NaN`` (and infinities as ``Infinity``), which RFC 8259 does not
allow: ``jq``, JavaScript's ``JSON.parse`` and Go's ``encoding/json`` refuse the whole line. A run whose episodes
never ended has no ``episode_return_mean`` yet; its result line says ``null`` instead.
"""

from __future__ import annotations

import json
import math
from typing import Any


def strict(value: Any) -> Any:
    """``value`` with every non-finite float (in nested dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def result_json(result: Any, **kwargs: Any) -> str:
    """``result`` as strict JSON text (non-finite floats as ``null``); ``kwargs`` go to :func:`json.dumps`."""
    return json.dumps(strict(result), allow_nan=False, **kwargs)


def print_result(result: Any) -> None:
    """Prints ``result`` as one line of strict JSON on stdout."""
    print(result_json(result))
