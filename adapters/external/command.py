"""A simulator's command template (``shoal train --external.command``, ``shoal conformance --command``): split
like a POSIX shell would (``shlex``; no shell ever runs it), each placeholder replaced in every argument:
``{host}``, ``{port}``, ``{seed}``, ``{sim_id}``, ``{token}``."""

from __future__ import annotations

import shlex

PLACEHOLDERS = ("host", "port", "seed", "sim_id", "token")


def render(command: str, *, flag: str = "external.command", **values: object) -> list[str]:
    """The argument list of ``command`` with placeholders replaced.

    Args:
        command: the template.
        flag: how the user gave it, for the errors (``external.command``, ``--command``).
        values: a value for each of :data:`PLACEHOLDERS`.

    Raises:
        ValueError: an empty command, unbalanced quotes, or a placeholder that is not one of ``{host}``,
            ``{port}``, ``{seed}``, ``{sim_id}``, ``{token}`` (named).
    """
    try:
        parts = shlex.split(command)
    except ValueError as error:
        raise ValueError(f"{flag} {command!r} does not split into arguments: {error}") from None
    if not parts:
        raise ValueError(f"{flag} is empty")
    out = []
    for part in parts:
        try:
            out.append(part.format_map({k: values[k] for k in PLACEHOLDERS}))
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"{flag} argument {part!r}: unknown placeholder {error}; the placeholders are "
                             + ", ".join("{" + p + "}" for p in PLACEHOLDERS)) from None
    return out


__all__ = ["PLACEHOLDERS", "render"]
