"""How the ``shoal`` commands tell a user's mistake: one paragraph on stderr and exit status 2, not a traceback."""

from __future__ import annotations

import contextlib
import re
import sys


@contextlib.contextmanager
def user_errors(command: str):
    """Turns a user's mistake found while setting a run up (a bad flag value, an unknown env id, agent or
    policy, a missing or refused checkpoint) into one paragraph on stderr and exit status 2, not a traceback.
    Errors once training runs (an env that raises) keep their traceback, except the mistakes
    :func:`is_users_mistake` names (a diverging update among them: :func:`exit_if_users_mistake`)."""
    try:
        yield
    except (ValueError, KeyError, LookupError, FileNotFoundError, ImportError, TimeoutError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"shoal {command}: {as_flags(str(message))}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as err:
        if not is_users_mistake(err, gymnasium=True):
            raise
        print(f"shoal {command}: {as_flags(str(err))}", file=sys.stderr)
        raise SystemExit(2) from None


#: The config records under TrainConfig, by the flag prefix their fields take.
_SECTIONS = {"PolicyConfig": "policy.", "PPOConfig": "ppo.", "RolloutConfig": "rollout.", "RayConfig": "ray.",
             "TeamCriticConfig": "team-critic.", "CuriosityConfig": "curiosity.", "PretrainConfig": "pretrain.",
             "PastSelvesConfig": "past-selves.", "ExternalConfig": "external.", "TrainConfig": ""}


def as_flags(message: str) -> str:
    """``message`` with the config fields that library code names (``PolicyConfig.recurrent_critic``) as the
    command's flags (``--policy.recurrent-critic``)."""
    flags = re.sub(r"\b(" + "|".join(_SECTIONS) + r")\.([a-z][a-z0-9_]*)",
                   lambda m: f"--{_SECTIONS[m.group(1)]}{m.group(2).replace('_', '-')}", message)
    return re.sub(r"(--[a-z][\w.-]*) \(\1\)", r"\1", flags)  # "Config.x (--x)" said the flag twice


def known(name: str, kind: str, choices) -> str:
    """``name`` when it is one of ``choices``; else a ValueError naming it as a ``kind`` and the nearest choice."""
    if name in choices:
        return name
    from core.envsets.ids import hint

    raise ValueError(f"no {kind} {name!r} in this run{hint(name, sorted(choices))}")


DIVERGED = "NonFiniteTraining"
"""The name of :class:`orchestration.learner.NonFiniteTraining` (imported only when an error is one: torch)."""


class StalledRun(RuntimeError):
    """An asynchronous run whose learners could not train while no fragment arrived for
    ``--ray.iteration-timeout-s``: the envs or workers deliver nothing (or the batch is far larger than what
    arrives in that time): the user's to look into, told in one paragraph by the ``shoal`` command."""


_COLOURS = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colour codes (tyro's box, a Ray actor's traceback)


def without_colours(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _COLOURS.sub("", text)


def is_users_mistake(err: Exception, gymnasium: bool = False) -> bool:
    """Whether ``err`` is the user's whenever it happens: launched simulators that never connect (a wrong
    command template), external simulators that deliver nothing for ``external.wait_s``, a stalled asynchronous
    run (:class:`StalledRun`), env data that breaks its tree (``adapters.checking.EnvOutputError``: a wrong shape,
    a value outside its space, a missing agent; the message names the env, agent and key, and Shoal's frames
    would say nothing more), updates that stay non-finite (``NonFiniteTraining``: the learning rate, the
    rewards), and with ``gymnasium`` gymnasium's id errors (they name the nearest id)."""
    from orchestration.external_launcher import NoSimulatorData, SimulatorsFailed  # light: no torch

    if type(err).__name__ == "EnvOutputError":  # imported only when it is one (adapters.checking imports torch)
        from adapters.checking import EnvOutputError

        return isinstance(err, EnvOutputError)
    if type(err).__name__ == DIVERGED:  # updates that stay non-finite: --lr or the env's rewards, told how
        from orchestration.learner import NonFiniteTraining

        return isinstance(err, NonFiniteTraining)
    if type(err).__name__ == "EnvWorkerFault":  # the same, found in an env process (--rollout.env-processes)
        from adapters.env_worker import EnvWorkerFault

        return isinstance(err, EnvWorkerFault) and err.env_output
    return (isinstance(err, (SimulatorsFailed, NoSimulatorData, StalledRun))
            or gymnasium and type(err).__module__.split(".")[0] == "gymnasium")


def users_mistake_within(err: BaseException) -> Exception | None:
    """The user's mistake (:func:`is_users_mistake`) that an error from another process carries as its cause (a
    Ray task error of a rollout worker: env data that breaks the tree there), else None. A fleet raises it as it
    is instead of re-creating the worker, whose new envs would fail alike."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, Exception) and is_users_mistake(cause) else None


def exit_if_users_mistake(err: BaseException, command: str, run_dir: str) -> None:
    """Ends a run that failed while training with one paragraph and exit status 2 when ``err`` (or, from a Ray
    actor, its cause) is the user's mistake, :func:`is_users_mistake`; returns otherwise (the caller re-raises).
    The run's checkpoint holds what was trained before the error: a diverged run is told how to continue."""
    if (mistake := err if is_users_mistake(err) else users_mistake_within(err)) is None:
        return
    again = (f" The checkpoints keep what was trained before it: continue with shoal {command} --resume "
             f"--run-dir {run_dir} and, say, a lower --lr") if type(mistake).__name__ == DIVERGED else ""
    print(f"shoal {command}: {as_flags(str(mistake))}{again}", file=sys.stderr)
    raise SystemExit(2) from None


__all__ = ["DIVERGED", "StalledRun", "exit_if_users_mistake", "is_users_mistake", "user_errors",
           "users_mistake_within", "without_colours"]
