"""Importing tensordict without importing ``torch._dynamo`` (quarantined here, with its equivalence test).

At import, tensordict marks a few functions for ``torch.compile`` with ``torch.compiler.allow_in_graph`` and
``torch.compiler.assume_constant_result``, and each of those calls imports ``torch._dynamo`` -- about a third
of the CPU a rollout worker spends starting up, for processes that never compile anything
(``benchmarks/worker_start.py``). While a ``tensordict`` module executes, :func:`install` puts two stand-ins
in their place:

- ``assume_constant_result(fn)`` sets ``fn._dynamo_marked_constant = True`` and returns ``fn``: what torch's
  own implementation does, without the import;
- ``allow_in_graph(fn)`` returns ``fn`` and records it; the recorded functions go to the real
  ``allow_in_graph`` the moment ``torch._dynamo`` is imported (by ``torch.compile``, torchrl, anyone), before
  the importer gets the module, so a compiled function sees what it would have seen without the deferral.

The originals are back as soon as the tensordict module has executed. Installed by ``import core`` (and so by
``orchestration`` and ``adapters``), which costs no import of torch; it does nothing when tensordict or
``torch._dynamo`` is already imported, or when ``SHOAL_DEFER_DYNAMO=0``.
Test: ``tests/core/test_dynamo_deferral.py`` (same functions marked, all registered once dynamo loads).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Callable

_lock = threading.RLock()
_deferred: list[Callable] = []  # passed to allow_in_graph while tensordict loaded, not yet registered
_depth = 0  # tensordict modules executing (nested imports)
_saved: tuple[Any, Any] | None = None  # the real torch.compiler functions while the stand-ins are in place
_dynamo_loaded = False  # torch._dynamo finished importing: a later call registers at once


def deferred() -> list[Callable]:
    """The functions whose ``allow_in_graph`` registration waits for ``torch._dynamo`` (for tests)."""
    with _lock:
        return list(_deferred)


def _allow_in_graph(fn):
    if isinstance(fn, (list, tuple)):
        return [_allow_in_graph(f) for f in fn]
    if not callable(fn):  # torch's own check, at the same moment
        raise AssertionError("allow_in_graph expects a callable")
    with _lock:
        if not _dynamo_loaded:
            _deferred.append(fn)
            return fn
    import torch._dynamo  # dynamo finished importing while tensordict loads: no need to wait

    return torch._dynamo.allow_in_graph(fn)


def _assume_constant_result(fn):
    fn._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result does
    return fn


def _patch() -> None:
    global _depth, _saved
    import torch.compiler  # before taking the lock: an import that fails leaves nothing half-done

    with _lock:
        _depth += 1
        if _depth == 1:
            _saved = (torch.compiler.allow_in_graph, torch.compiler.assume_constant_result)
            torch.compiler.allow_in_graph = _allow_in_graph
            torch.compiler.assume_constant_result = _assume_constant_result


def _unpatch(module: Any, executed: bool) -> None:
    global _depth, _saved
    with _lock:
        _depth -= 1
        if _depth == 0 and _saved is not None:
            import torch.compiler

            torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = _saved
            _saved = None


def _register_deferred(module: Any, executed: bool) -> None:
    """After ``torch._dynamo`` executed: registers what waited. Never raises (an exception here would fail the
    importer's ``import torch._dynamo``); a function dynamo refuses is named in a warning."""
    global _dynamo_loaded
    if not executed:  # its import failed: whoever imports it next gets another go
        return
    with _lock:
        _dynamo_loaded = True
        pending, _deferred[:] = list(_deferred), []
    for fn in pending:
        try:
            module.allow_in_graph(fn)
        except Exception as error:  # noqa: BLE001 - see the docstring
            warnings.warn(f"core.dynamo_deferral: torch._dynamo.allow_in_graph({fn!r}) raised {error!r}; "
                          "torch.compile will trace into it", RuntimeWarning, stacklevel=2)


def _no_before() -> None:
    pass


class _Wrapped:
    """A loader that runs ``before()`` and ``after(module, executed)`` around another's ``exec_module`` and is
    that loader for everything else (``get_source``, ``get_resource_reader``, ...)."""

    def __init__(self, loader, before: Callable[[], None], after: Callable[[Any, bool], None]) -> None:
        self._loader, self._before, self._after = loader, before, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._before()
        executed = False
        try:
            self._loader.exec_module(module)
            executed = True
        finally:
            self._after(module, executed)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_loader", "_before", "_after"):  # copy/pickle probing
            raise AttributeError(name)
        return getattr(self._loader, name)


class _Finder:
    """A ``sys.meta_path`` finder that wraps the loaders of ``tensordict`` (and its submodules) and of
    ``torch._dynamo``, as found by the finders after it."""

    def find_spec(self, name: str, path=None, target=None):
        if name == "torch._dynamo":
            wrap: tuple = (_no_before, _register_deferred)
        elif name == "tensordict" or name.startswith("tensordict."):
            wrap = (_patch, _unpatch)
        else:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None:
                continue
            loader = spec.loader
            if loader is not None and hasattr(loader, "exec_module") and hasattr(loader, "create_module") \
                    and not isinstance(loader, _Wrapped):
                spec.loader = _Wrapped(loader, *wrap)
            return spec
        return None


_finder: _Finder | None = None


def install() -> None:
    """Defers dynamo for the tensordict imports to come (module doc); idempotent."""
    global _finder
    if (_finder is not None or os.environ.get("SHOAL_DEFER_DYNAMO", "1") == "0"
            or "tensordict" in sys.modules or "torch._dynamo" in sys.modules):
        return
    _finder = _Finder()
    sys.meta_path.insert(0, _finder)
