"""Whether a ``host:port`` address a user gave accepts connections, checked before a library that would retry
it for minutes (Ray's ``ray.init``) is handed it."""

from __future__ import annotations

import socket


def check_reachable(address: str, flag: str, timeout_s: float = 5.0) -> None:
    """Raises ValueError naming ``flag`` when ``address`` is ``host:port`` and nothing accepts a TCP connection
    there within ``timeout_s`` (``auto`` and ``ray://`` addresses are left to Ray)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ValueError(f"cannot reach a Ray cluster at {flag} {address!r} ({error.strerror or error}): start one "
                         f"(`ray start --head` prints its address) or leave out {flag} for a local Ray "
                         f"instance") from None


__all__ = ["check_reachable"]
