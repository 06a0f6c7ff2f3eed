"""Shoal's functional core: pure tensordict data structures and math (module docs of the subpackages).

Importing the package imports no torch; it defers ``torch._dynamo`` for the tensordict import to come
(:mod:`core.dynamo_deferral`).
"""

from core import dynamo_deferral as _dynamo_deferral

_dynamo_deferral.install()
