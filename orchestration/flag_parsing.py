"""The ``shoal`` commands' flag parsing (tyro), with a refusal told in one paragraph.

tyro refuses an unknown flag, a value of the wrong kind, or a value a config's ``__post_init__`` rejects by
printing a box of several lines on stderr (the message, the flag's help, a footer) and exiting with 2.
:func:`parse` captures what tyro writes while it parses and tells such a refusal in one line, ``shoal
<command>: <message>``: config fields named as flags (:func:`orchestration.user_errors.as_flags`), tyro's
nearest flag kept as "did you mean". Text it does not read as tyro's box is passed on as tyro wrote it. Only the
parsing is captured: a function that tyro calls (``shoal evaluate``'s) writes to stderr as usual.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys
from typing import Any, Callable

from orchestration.user_errors import as_flags

_EDGE, _RULE = "\u2502", "\u2500"  # the box's side and its separator lines


def parse(command: str, target: Callable, **tyro_kwargs: Any) -> Any:
    """``tyro.cli(target, **tyro_kwargs)``, refusing a bad flag in one paragraph (exit code 2)."""
    import tyro

    real = sys.stderr
    if not isinstance(target, type):  # a function tyro calls once parsed: it writes where the caller does
        inner = target

        @functools.wraps(inner)
        def target(*args: Any, **kwargs: Any) -> Any:
            with contextlib.redirect_stderr(real):
                return inner(*args, **kwargs)

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(target, **tyro_kwargs)
    except SystemExit as exit_:
        told = one_paragraph(captured.getvalue(), command) if exit_.code not in (0, None) else None
        if told is None:
            raise
        captured = io.StringIO()
        print(f"shoal {command}: {told}", file=real)
        raise SystemExit(2) from None
    finally:
        real.write(captured.getvalue())


def one_paragraph(box: str, command: str) -> str | None:
    """The refusal in tyro's ``box`` as one line (None: not such a box): its message, the flag tyro suggests
    ("Perhaps you meant") or the form the flag takes ("Argument helptext"), and where the flags are listed."""
    rows = _rows(box)
    if not rows:
        return None
    sections: list[list[str]] = [[]]
    for row in rows:
        if _is_rule(row):
            sections.append([])
        else:
            sections[-1].append(row)
    message = " ".join(" ".join(row.split()) for row in sections[0] if row.strip())
    if named := re.fullmatch(r"Error parsing (\S+): (.*)", message):  # "--lr: ..." kept; "policy: ..." dropped
        message = f"{named[1]}: {named[2]}" if named[1].startswith("-") else named[2]
    told = [as_flags(message)]
    for section in sections[1:]:
        head, flags = (section[0].strip() if section else ""), _flag_rows(section[1:])
        if head.startswith("Perhaps you meant") and flags:
            told.append("did you mean " + " or ".join(dict.fromkeys(f.split()[0] for f in flags)) + "?")
        elif head.startswith("Argument helptext") and flags:
            told.append(f"it takes {flags[0]}")
    return "; ".join(told) + f" (shoal {command} --help lists every flag)"


def _rows(box: str) -> list[str]:
    """The lines inside tyro's box: between its sides (UTF-8 output), or (ASCII output, drawn without sides)
    those after its title and the rule below it; [] when ``box`` is neither."""
    lines = [line.rstrip() for line in box.splitlines() if line.strip()]
    if any(line.lstrip().startswith(_EDGE) for line in lines):
        return [line.strip()[1:-1].rstrip() for line in lines
                if len(line.strip()) > 1 and line.strip()[0] == line.strip()[-1] == _EDGE]
    return lines[2:] if len(lines) > 2 and _is_rule(lines[1]) and not _is_rule(lines[0]) else []


def _is_rule(row: str) -> bool:
    return len(row.strip()) >= 8 and set(row.strip()) <= {_RULE, "-"}


def _flag_rows(rows: list[str]) -> list[str]:
    """The rows of a section that give a flag and its form (``--lr FLOAT``), not the lines of its help below."""
    starts = [row for row in rows if row.lstrip().startswith("-")]
    indent = min((len(row) - len(row.lstrip()) for row in starts), default=0)
    return [" ".join(row.split()) for row in starts if len(row) - len(row.lstrip()) == indent]


__all__ = ["one_paragraph", "parse"]
