"""Other people's environments as Shoal batched envs (:class:`adapters.protocol.BatchedEnv`).

Submodules import their frameworks lazily: ``adapters.gymnasium_env`` needs gymnasium,
``adapters.pettingzoo_env`` PettingZoo, ``adapters.torchrl_env`` torchrl, ``adapters.builtin`` only torch, and
``adapters.external.client`` (what a simulator embeds) only numpy, msgpack and websockets: the names below are
imported on first use, so importing the package costs nothing. It imports ``core`` first (no torch), so that
:mod:`core.dynamo_deferral` is in place before any tensordict.
"""

from __future__ import annotations

import importlib
from typing import Any

import core  # noqa: F401

_EXPORTS = {"CheckMode": "adapters.checking", "EnvOutputError": "adapters.checking",
            "IllegalActionError": "adapters.checking", "validate_step": "adapters.checking",
            "BatchedEnv": "adapters.protocol"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'adapters' has no attribute {name!r}")


__all__ = ["BatchedEnv", "CheckMode", "EnvOutputError", "IllegalActionError", "validate_step"]
