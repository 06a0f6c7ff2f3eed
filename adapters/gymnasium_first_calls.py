"""The gymnasium API's form, checked on each sub-env's first ``reset`` and ``step`` (:func:`check_first_calls`).

A ``SyncVectorEnv`` stores what its sub-envs return without looking: a ``"False"`` string as a flag becomes
True (every step ends the episode, in silence), and an old-API ``step`` of 4 values or a ``reset`` of the
observation alone fail inside gymnasium with an unpacking error that names neither the env nor the method.
The first call of each is checked, then the sub-env's own method is back: nothing is left in the hot path.
"""

from __future__ import annotations

from typing import Any

from core.layout import NEXT, OBSERVATION, TERMINATED, TRUNCATED

from .checking import EnvOutputError, is_flag
from .gymnasium_base import AGENT


def check_first_calls(env: Any, index: int) -> None:
    """Wraps sub-env ``index``'s ``reset`` and ``step`` until their first call; raises :class:`EnvOutputError`
    naming the sub-env and the value when that call's result is not of the gymnasium (>= 0.26) form."""
    reset, step = env.reset, env.step

    def first_reset(*args: Any, **kwargs: Any):
        del env.reset  # the env's own from now on
        out = reset(*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise EnvOutputError(f"reset() returned {_form(out)}; it returns (observation, info) with info a dict "
                                 f"(the gymnasium >= 0.26 API)", env_index=index, agent=AGENT, key=(OBSERVATION,))
        return out

    def first_step(*args: Any, **kwargs: Any):
        del env.step
        out = step(*args, **kwargs)
        if not (isinstance(out, tuple) and len(out) == 5):
            raise EnvOutputError(f"step() returned {_form(out)}; it returns (observation, reward, terminated, "
                                 f"truncated, info) (the gymnasium >= 0.26 API: done split into terminated and "
                                 f"truncated)", env_index=index, agent=AGENT, key=(NEXT,))
        for name, flag in ((TERMINATED, out[2]), (TRUNCATED, out[3])):
            if not is_flag(flag):
                raise EnvOutputError(f"step() returned {name} {flag!r} ({type(flag).__name__}), not a bool (a "
                                     f"vector env would read any non-empty string as True)", env_index=index,
                                     agent=AGENT, key=(NEXT, AGENT, name))
        if not isinstance(out[4], dict):
            raise EnvOutputError(f"step() returned info {out[4]!r}, not a dict", env_index=index, agent=AGENT,
                                 key=(NEXT,))
        return out

    env.reset, env.step = first_reset, first_step


def _form(out: Any) -> str:
    return f"a tuple of {len(out)} values" if isinstance(out, tuple) else f"a {type(out).__name__}"


__all__ = ["check_first_calls"]
