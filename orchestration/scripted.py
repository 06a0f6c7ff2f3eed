"""Scripted players: a Python function as an opponent (``shoal evaluate CKPT --opponent scripted:MODULE:FUNCTION``).

The function decides every agent's action of a group at once, batched over envs::

    def center_first(observation, action_mask):      # observation [E, A, *obs], action_mask [E, A, n] or None
        ...
        return actions                              # [E, A] (discrete), or shaped like the policy's actions

:class:`ScriptedPolicy` gives it the acting interface of a :class:`core.policies.GroupPolicy`, so an actor plays
it like any fixed policy: the group's uniform policy computes what an actor records besides the action (log-
probabilities, values), and the function's actions replace the sampled ones. The module is imported because
the user named it on the command line; a checkpoint never names one.

Usage::

    player = ScriptedPolicy(policy, load_function("examples.scripted_connect_four:center_first"))
    actor = build_evaluator(config, {**policies, "opponent": player}, assignment, fixed)
"""

from __future__ import annotations

import copy
import importlib
from typing import Callable

import torch

from core.layout import ACTION, ACTION_MASK, OBSERVATION
from core.policies import GroupPolicy


def load_function(spec: str) -> Callable:
    """The function ``MODULE:FUNCTION`` names (``scripted:`` prefix allowed). Raises ValueError naming what is
    missing: the form, the module or the attribute."""
    spec = spec.removeprefix("scripted:")
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"a scripted player is named MODULE:FUNCTION (e.g. scripted:examples.scripted_connect_four:"
                         f"center_first), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"scripted player {spec!r}: no module {module_name!r} ({err}); run from the directory "
                         f"that holds it or put it on PYTHONPATH") from None
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"scripted player {spec!r}: module {module_name!r} has no function {name!r}; its "
                         f"functions are {found}")
    return function


class ScriptedPolicy(torch.nn.Module):
    """``act(observation, action_mask) -> actions`` playing a group, with a policy's acting interface (a module,
    so actors copy and move it like a policy; its only parameters are the uniform policy's).

    Args:
        policy: a policy of the group (its architecture only: a uniform copy records log-probabilities).
        act: the scripted function (module docstring).
    """

    recurrent = False
    reads_episode_starts = False

    def __init__(self, policy: GroupPolicy, act: Callable) -> None:
        super().__init__()
        self.policy = copy.deepcopy(policy)
        with torch.no_grad():  # uniform over legal actions: what it records besides the action is well defined
            self.policy.actor_out.weight.zero_()
            self.policy.actor_out.bias.zero_()
        self.act = act
        self.num_agents, self.defers_log_prob, self.group_name = policy.num_agents, policy.defers_log_prob, \
            policy.group_name

    def act_step(self, obs, shared=None, generator: torch.Generator | None = None, deterministic: bool = False,
                 recurrent_state: torch.Tensor | None = None, episode_start: torch.Tensor | None = None,
                 with_value: bool = True, with_log_prob: bool = True) -> dict:
        """The uniform policy's outputs with the function's actions (``[E, A]``, checked)."""
        out = dict(self.policy.act_step(obs, shared, generator, deterministic, None, None, with_value, with_log_prob))
        expected = out[ACTION]
        observation = obs[OBSERVATION]
        try:
            actions = torch.as_tensor(self.act(observation, obs.get(ACTION_MASK, None)))
        except Exception as err:  # a player written for another env, most often: said with what it was given
            name = f"{getattr(self.act, '__module__', '?')}:{getattr(self.act, '__qualname__', self.act)}"
            raise ValueError(f"scripted player {name} of group {self.group_name!r} failed on observations of shape "
                             f"{tuple(observation.shape)} ([envs, agents, ...]): {type(err).__name__}: {err}. Is it "
                             f"written for this env?") from err
        if actions.shape != expected.shape:
            raise ValueError(f"scripted player of group {self.group_name!r} returned actions of shape "
                             f"{tuple(actions.shape)}; the group needs {tuple(expected.shape)} ([envs, agents])")
        out[ACTION] = actions.to(expected.dtype)
        return out

    def log_prob_from_params(self, params: torch.Tensor, action, action_mask: torch.Tensor | None = None):
        """The uniform policy's (:meth:`core.policies.GroupPolicy.log_prob_from_params`)."""
        return self.policy.log_prob_from_params(params, action, action_mask)


__all__ = ["ScriptedPolicy", "load_function"]
