"""The ``shoal`` commands' flag parsing (tyro), with a refusal told in one paragraph.

tyro refuses an unknown flag, a value of the wrong kind, or a value a config's ``__post_init__`` rejects by
printing a box of several lines on stderr (the message, the flag's help, a footer) and exiting with 2.
:func:`parse` captures what tyro writes while it parses and tells such a refusal in one line, ``shoal
<command>: <message>``: config fields named as flags (:func:`orchestration.user_errors.as_flags`), tyro's
nearest flags kept as "did you mean". What tyro wrote before its box (a warning) is passed on, and so is text
it does not read as tyro's box. Only the parsing is captured: a function that tyro calls (``shoal evaluate``'s)
writes to stderr as usual. The box is drawn wide while parsing (no line of it wraps a flag), in colour or not,
with sides (UTF-8) or without (ASCII): each form is read.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import sys
from typing import Any, Callable, Iterator

from orchestration.user_errors import as_flags, without_colours

_EDGE, _RULE, _CORNER = "\u2502", "\u2500", "\u256d"  # the box's side, its separator lines, its first corner
_WIDE = "2000"  # COLUMNS while parsing: the box as wide as its longest line


def parse(command: str, target: Callable, **tyro_kwargs: Any) -> Any:
    """``tyro.cli(target, **tyro_kwargs)``, refusing a bad flag in one paragraph (exit code 2)."""
    import tyro

    real, columns, captured = sys.stderr, os.environ.get("COLUMNS"), io.StringIO()
    if not isinstance(target, type):  # a function tyro calls once parsed: it writes where the caller does
        inner = target

        @functools.wraps(inner)
        def target(*args: Any, **kwargs: Any) -> Any:
            real.write(_taken(captured))  # what parsing wrote, before the function's own output
            with contextlib.redirect_stderr(real), _columns(columns):
                return inner(*args, **kwargs)

    help_asked = any(arg in ("-h", "--help") for arg in tyro_kwargs.get("args") or sys.argv[1:])
    try:
        with contextlib.redirect_stderr(captured), _columns(columns if help_asked else _WIDE):
            return tyro.cli(target, **tyro_kwargs)
    except SystemExit as exit_:
        before, told = split_refusal(captured.getvalue(), command) if exit_.code not in (0, None) else ("", None)
        if told is None:
            raise
        _taken(captured)
        real.write(before)
        print(f"shoal {command}: {told}", file=real)
        raise SystemExit(2) from None
    finally:
        real.write(_taken(captured))


def split_refusal(text: str, command: str) -> tuple[str, str | None]:
    """``(what came before tyro's box, the box's refusal as one line)``; ``(text, None)`` when ``text`` holds no
    box (:func:`one_paragraph`)."""
    lines = without_colours(text).splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(_CORNER)]  # UTF-8: its top corner
    starts = starts or [i - 1 for i, line in enumerate(lines) if i and _is_rule(line)]  # ASCII: the title line
    if not starts:
        return text, None
    told = one_paragraph("".join(lines[starts[0]:]), command)
    return ("".join(lines[:starts[0]]), told) if told is not None else (text, None)


def one_paragraph(box: str, command: str) -> str | None:
    """The refusal in tyro's ``box`` as one line (None: not such a box): its message, the flags tyro suggests
    ("Perhaps you meant", "Arguments similar to --X") or the form the flag takes ("Argument helptext"), and
    where the flags are listed."""
    rows = _rows(without_colours(box))
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
    told, similar = [as_flags(message)], []  # similar: (where the flag is in the message, its suggestion)
    for section in sections[1:]:
        head, flags = (section[0].strip() if section else ""), _flag_rows(section[1:])
        if head.startswith("Perhaps you meant") and flags:
            told.append("did you mean " + " or ".join(dict.fromkeys(f.split()[0].rstrip(",") for f in flags)) + "?")
        elif (asked := re.fullmatch(r"Arguments similar to (\S+):", head)) and flags:
            similar.append((message.find(asked[1]), f"{flags[0].split()[0].rstrip(',')} for {asked[1]}"))
        elif head.startswith("Argument helptext") and flags:
            told.append(f"it takes {flags[0]}")
    if similar:
        told.append(f"did you mean {', '.join(text for _, text in sorted(similar))}?")  # in the order given
    if command in ("train", "league") and (left := re.fullmatch(r"Unrecognized options: (.*)", message)):
        words = left[1].split(", ")  # a word right after an unknown flag is that flag's value, not an env
        envs = [w for i, w in enumerate(words) if not (i and words[i - 1].startswith("-"))
                and re.fullmatch(r"[\w.]+:\S+|[A-Za-z][\w/.-]*-v\d+", w)]
        if envs:  # the env after other flags: read as the env only first, as shoal train ENV [flags]
            told.append(f"the env goes first (shoal {command} {envs[0]} ...) or after --env")
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


def _taken(buffer: io.StringIO) -> str:
    """``buffer``'s text, emptying it."""
    text = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return text


@contextlib.contextmanager
def _columns(value: str | None) -> Iterator[None]:
    """``COLUMNS`` set to ``value`` (None: unset) inside the block, as it was after."""
    before = os.environ.get("COLUMNS")
    _set_columns(value)
    try:
        yield
    finally:
        _set_columns(before)


def _set_columns(value: str | None) -> None:
    if value is None:
        os.environ.pop("COLUMNS", None)
    else:
        os.environ["COLUMNS"] = value


__all__ = ["one_paragraph", "parse", "split_refusal"]
