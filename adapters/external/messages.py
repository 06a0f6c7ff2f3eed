"""Messages of the external-environment protocol, version 1 (docs/external-protocol.md): MessagePack maps in
binary WebSocket frames, arrays as ``{"dtype", "shape", "data"}``. Numpy only (no torch, no websockets):
shared by the server (:mod:`orchestration.external_server`), the simulator client
(:mod:`adapters.external.client`) and the conformance kit.

Nothing here executes or unpickles what it reads: :func:`decode` refuses MessagePack extension types and
bounds every length; :func:`to_array` checks dtype, shape and byte count before viewing the bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Mapping

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
CLIENT_TYPES = frozenset({"hello", "act", "end", "ping", "pong", "bye", "get_policy", "trajectory"})
SERVER_TYPES = frozenset({"welcome", "actions", "pong", "ping", "error", "policy", "accepted"})
ERROR_CODES = ("bad_message", "protocol_version", "bad_token", "spec_mismatch", "too_large", "spec_violation",
               "unknown_episode", "busy", "internal")
MAX_NAME = 128  # episode ids, sim ids, agent names
_NATIVE = {name: np.dtype(name) for name in DTYPES}
_LITTLE = {name: d.newbyteorder("<") for name, d in _NATIVE.items()}


class ProtocolError(ValueError):
    """A message that breaks the protocol; ``code`` is one of :data:`ERROR_CODES`, ``fatal`` closes the link."""

    def __init__(self, code: str, message: str, *, fatal: bool = True, request: Any = None,
                 episode: str | None = None) -> None:
        super().__init__(message)
        self.code, self.fatal, self.request, self.episode = code, fatal, request, episode

    def as_message(self) -> dict[str, Any]:
        """The ``error`` message that reports it."""
        out: dict[str, Any] = {"type": "error", "code": self.code, "message": str(self), "fatal": self.fatal}
        if self.request is not None:
            out["id"] = self.request
        if self.episode is not None:
            out["episode"] = self.episode
        return out


# -- frames ----------------------------------------------------------------------------------------------
def encode(message: Mapping[str, Any]) -> bytes:
    """One message as a MessagePack frame (numpy arrays anywhere inside become array maps)."""
    return msgpack.packb(message, use_bin_type=True, default=_default)


def _default(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)):  # a numpy scalar keeps its dtype: a 0-d array
        return from_array(value)
    raise TypeError(f"cannot send a {type(value).__name__} in a protocol message")


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("bad_message", f"MessagePack extension type {code} is not part of the protocol")


def decode(frame: bytes | str, *, max_bytes: int, allowed: frozenset[str] = CLIENT_TYPES) -> dict[str, Any]:
    """A frame as a message map, or :class:`ProtocolError` naming what is wrong with it."""
    if isinstance(frame, str):
        raise ProtocolError("bad_message", "text frame: every message is a binary frame holding a MessagePack map")
    if len(frame) > max_bytes:
        raise ProtocolError("too_large", f"frame of {len(frame)} bytes; the limit is {max_bytes}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, ext_hook=_no_ext, max_bin_len=max_bytes,
                                  max_str_len=max_bytes, max_array_len=max_bytes, max_map_len=max_bytes)
    except ProtocolError:
        raise
    except Exception as error:  # noqa: BLE001 - msgpack raises several types for malformed input
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise ProtocolError("bad_message", f"not a MessagePack message ({why})") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("bad_message", "a message is a map with a string 'type'")
    if message["type"] not in allowed:
        raise ProtocolError("bad_message", f"unknown message type {message['type']!r}; expected one of "
                                           f"{sorted(allowed)}")
    return message


# -- arrays ----------------------------------------------------------------------------------------------
def from_array(value: np.ndarray) -> dict[str, Any]:
    """A numpy array as an array map (little-endian, C order)."""
    a = np.asarray(value)
    name = a.dtype.name
    if name not in DTYPES:
        raise TypeError(f"dtype {name} is not in the protocol ({', '.join(DTYPES)})")
    a = a.astype(_LITTLE[name], copy=False)  # (np.ascontiguousarray would make a 0-d array 1-d)
    return {"dtype": name, "shape": list(a.shape), "data": a.tobytes(order="C")}


def to_array(value: Any, what: str) -> np.ndarray:
    """An array map (or a plain number, shape ``[]``) as a numpy array of its own memory.

    Raises:
        ProtocolError: ``bad_message`` naming ``what`` when the map is malformed.
    """
    if isinstance(value, np.ndarray):  # already decoded (a local caller, never a frame off the wire)
        return np.array(value, copy=True)
    if isinstance(value, bool):
        return np.array(value)
    if isinstance(value, int) and not -2**63 <= value < 2**63:
        raise ProtocolError("bad_message", f"{what}: {value} does not fit any protocol dtype (int64 at most)")
    if isinstance(value, (int, float)):
        return np.array(value, dtype=np.int64 if isinstance(value, int) else np.float64)
    if not isinstance(value, dict):
        raise ProtocolError("bad_message", f"{what}: expected an array map {{dtype, shape, data}} or a number, "
                                           f"got a {type(value).__name__}")
    dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if dtype not in DTYPES:
        raise ProtocolError("bad_message", f"{what}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > 16
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise ProtocolError("bad_message", f"{what}: shape must be a list of at most 16 ints >= 0, got {shape!r}")
    if not isinstance(data, bytes):
        raise ProtocolError("bad_message", f"{what}: data must be bytes (MessagePack bin)")
    dt = _LITTLE[dtype]
    expected = math.prod(shape) * dt.itemsize
    if len(data) != expected:
        raise ProtocolError("bad_message", f"{what}: {len(data)} bytes for dtype {dtype} shape {shape}; "
                                           f"expected {expected}")
    out = np.frombuffer(data, dtype=dt).reshape(shape).astype(_NATIVE[dtype], copy=True)
    if dtype == "bool" and data and max(data) > 1:
        raise ProtocolError("bad_message", f"{what}: bool data holds bytes other than 0 and 1")
    return out


def spec_hash(tree_document: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the tree document as JSON with sorted keys and no whitespace."""
    text = json.dumps(tree_document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def tree_difference(mine: Any, run: Any, path: str = "", *, here: str = "here", there: str = "in the run's") -> str:
    """The first place where two tree documents (:func:`spec_hash`'s input) differ, e.g. ``at
    tree/array/template/action/n: 4 here, 3 in the run's``: what a simulator's developer has to change
    (``here`` and ``there`` name the two sides)."""
    if isinstance(mine, dict) and isinstance(run, dict):
        for key in sorted(set(mine) | set(run)):
            if key not in run:
                return f"{path}{key} is not {there} tree"
            if key not in mine:
                return f"{path}{key} is missing {here}"
            if mine[key] != run[key]:
                return tree_difference(mine[key], run[key], f"{path}{key}/", here=here, there=there)
    if isinstance(mine, list) and isinstance(run, list) and len(mine) == len(run):
        for i, (a, b) in enumerate(zip(mine, run)):
            if a != b:
                return tree_difference(a, b, f"{path}{i}/", here=here, there=there)
    return f"at {path.rstrip('/') or 'the root'}: {json.dumps(mine)[:80]} {here}, {json.dumps(run)[:80]} {there}"


# -- field checks (each names the message and field at fault) ---------------------------------------------
def field(message: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *, optional: bool = False,
          request: Any = None, episode: str | None = None, fatal: bool = True) -> Any:
    """``message[name]`` if it is a ``kind`` (bools are not ints); None when optional and absent."""
    if name not in message:
        if optional:
            return None
        raise ProtocolError("bad_message", f"{message.get('type')!r} message without its {name!r} field",
                            fatal=fatal, request=request, episode=episode)
    value = message[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError("bad_message", f"{message.get('type')!r} field {name!r} must be "
                                           f"{' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}",
                            fatal=fatal, request=request, episode=episode)
    return value


def name_field(message: Mapping[str, Any], name: str, **kw: Any) -> str:
    """A non-empty string field of at most :data:`MAX_NAME` characters."""
    value = field(message, name, str, **kw)
    if not 1 <= len(value) <= MAX_NAME:
        raise ProtocolError("bad_message", f"{message.get('type')!r} field {name!r} must be 1-{MAX_NAME} characters",
                            fatal=kw.get("fatal", True), request=kw.get("request"), episode=kw.get("episode"))
    return value


__all__ = ["CLIENT_TYPES", "DTYPES", "ERROR_CODES", "PROTOCOL_VERSION", "ProtocolError", "SERVER_TYPES", "decode",
           "encode", "field", "from_array", "name_field", "spec_hash", "to_array", "tree_difference"]
