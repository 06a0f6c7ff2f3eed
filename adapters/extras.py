"""Optional environment families: which ``shoal[...]`` extra installs the package an env needs, and the error
that says so.

Gymnasium and PettingZoo's adapters are always installed; the environment families below are not
(``pyproject.toml``'s optional dependencies). Building an env of a family whose package is missing raises
:class:`MissingExtra`, one paragraph naming the command that installs it, instead of a traceback ending in
``ModuleNotFoundError``. ``shoal train`` prints it as a user error (exit status 2).

    require("vmas:navigation", "vmas")                 # raises MissingExtra without vmas
    extra_for("pygame", family="mpe2")                  # "mpe2": mpe2 brings pygame-ce with it
"""

from __future__ import annotations

import importlib.util
import sys

EXTRAS: dict[str, str] = {"mpe2": "mpe2", "vmas": "vmas", "Box2D": "box2d", "pymunk": "butterfly",
                          "pygame": "classic"}
"""Top-level module -> the extra of ``pyproject.toml`` that installs it (``shoal[<extra>]``)."""

_PYGAME_BY_FAMILY = {"mpe2": "mpe2", "butterfly": "butterfly", "sisl": "butterfly"}
"""Families that draw with pygame but are installed by an extra other than ``classic``."""


class MissingExtra(ImportError):
    """An env needs an optional package that is not installed; the message names the extra that brings it."""


def extra_for(module: str, family: str = "") -> str | None:
    """The extra that installs top-level ``module`` for an env of ``family`` (``mpe2``, ``classic``,
    ``butterfly``, ...), or None when no extra of Shoal does."""
    top = module.split(".")[0]
    if top == "pygame":
        return _PYGAME_BY_FAMILY.get(family, "classic")
    return EXTRAS.get(top)


def missing_extra(env: str, module: str, extra: str) -> MissingExtra:
    """The error for env ``env``, which needs ``module`` that the ``extra`` extra installs."""
    return MissingExtra(
        f"env {env!r} needs the optional package {module.split('.')[0]!r}, which is not installed. Install "
        f"Shoal's {extra!r} extra: pip install 'shoal[{extra}]' (from a checkout: pip install -e '.[{extra}]'; "
        f"'shoal[all]' brings every optional environment family).", name=module)


def is_installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported (without importing it; a ``None`` entry in
    ``sys.modules``, which blocks an import, counts as missing)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def require(env: str, module: str, family: str = "") -> None:
    """Raises :class:`MissingExtra` naming the extra when ``module``, which env ``env`` needs, is missing.

    Raises:
        MissingExtra: ``module`` cannot be imported.
    """
    if not is_installed(module):
        raise missing_extra(env, module, extra_for(module, family) or "all")


__all__ = ["EXTRAS", "MissingExtra", "extra_for", "is_installed", "missing_extra", "require"]
