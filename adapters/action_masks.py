"""Where an env's action masks come from: an ``"action_mask"`` entry of its observation ``Dict``, or
``info["action_mask"]`` (PettingZoo's two conventions, which gymnasium envs such as Taxi-v4 follow too).

The adapters take the mask out of the observation (the tree's observation is the rest: the ``"observation"``
entry alone when only it is left) and hand it to the step as ``(group, "action_mask")``, where the policies
read it; ``action_mask="none"`` (``--env-kwargs action_mask none``) leaves a mask in the observation and ignores
one in ``info``. Shoal applies masks to one ``Discrete`` action: a mask beside any other action is refused,
never dropped (its illegal actions would be chosen and trained on).
"""

from __future__ import annotations

from gymnasium import spaces

from core.layout import OBSERVATION

MASK_KEY = "action_mask"
MASK_SOURCES = ("auto", "observation", "info", "none")
"""``action_mask=``: the observation ``Dict`` if it has the entry, else ``info`` (``auto``); one of them; none."""


def check_source(action_mask: str) -> str:
    """``action_mask`` when it is one of :data:`MASK_SOURCES`; else a ValueError naming them."""
    if action_mask not in MASK_SOURCES:
        raise ValueError(f"action_mask must be {', '.join(MASK_SOURCES[:-1])} or none, got {action_mask!r}")
    return action_mask


def split_mask(space: spaces.Space, action_mask: str) -> tuple[spaces.Space, bool]:
    """The observation space without its ``"action_mask"`` entry, and whether it had one (and it is used)."""
    if action_mask == "none" or not isinstance(space, spaces.Dict) or MASK_KEY not in space.spaces:
        return space, False
    rest = {k: s for k, s in space.spaces.items() if k != MASK_KEY}
    if set(rest) == {OBSERVATION}:
        return rest[OBSERVATION], True
    return spaces.Dict(rest), True


def without_mask(observation):
    """``(observation without its mask, mask)`` of a sample (or a batch: a dict of arrays) whose space
    :func:`split_mask` split; ``(observation, None)`` when it has no mask entry (the caller's check names it)."""
    try:
        mask = observation[MASK_KEY]
    except (KeyError, TypeError, IndexError):
        return observation, None
    rest = {k: v for k, v in observation.items() if k != MASK_KEY}
    return (rest[OBSERVATION] if set(rest) == {OBSERVATION} else rest), mask


def unmaskable(who: str, action_space: spaces.Space | None, where: str) -> str:
    """Why the action mask that ``who``'s ``where`` (observation or info) carries cannot be applied."""
    action = f" (its action space is {action_space})" if action_space is not None else ""
    return (f"{who} has an {MASK_KEY!r} in its {where}, but Shoal applies an env's action mask to a Discrete "
            f"action only{action}: it would train unmasked, its illegal actions chosen. Pass --env-kwargs "
            f"action_mask none to train without the mask, or give it a Discrete action")


__all__ = ["MASK_KEY", "MASK_SOURCES", "check_source", "split_mask", "unmaskable", "without_mask"]
