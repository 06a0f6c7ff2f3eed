"""Network addresses a user gives: whether a ``host:port`` accepts connections, checked before a library that
would retry it for minutes (Ray's ``ray.init``) is handed it; whether a host is loopback only; a WebSocket URL."""

from __future__ import annotations

import ipaddress
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


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_url(host: str, port: int, tls: bool) -> str:
    """``ws://host:port`` (``wss`` with TLS); an IPv6 address in brackets (RFC 3986)."""
    return f"{'wss' if tls else 'ws'}://{f'[{host}]' if ':' in host else host}:{port}"


__all__ = ["check_reachable", "is_loopback", "server_url"]
