"""Ecosystem views of the built-in envs, so gymnasium's and PettingZoo's own checkers can run on them.

- :func:`as_gymnasium`: one :class:`~adapters.builtin.cartpole.CartPole` as a ``gymnasium.Env``;
- :func:`as_pettingzoo`: one :class:`~adapters.builtin.spread.Spread` as a PettingZoo ``ParallelEnv``
  (agents join and leave; ``state()`` is the shared observation).

Both wrap a batch of one env. The batched env resets an ended episode inside ``step``; the views hide that
reset and expect ``reset()`` after an episode ends, as gymnasium and PettingZoo do (stepping on instead
continues in the batched env's fresh episode).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import gymnasium
import numpy as np
import torch
from pettingzoo import ParallelEnv
from tensordict import TensorDict

from core.layout import ACTION, DONE, MASK, NEXT, OBSERVATION, REWARD, SHARED, TERMINATED, TRUNCATED
from core.specs import Leaf, groups, leaf_bounds, shared_observations

from .cartpole import CartPole, CartPoleConfig
from .spread import Spread, SpreadConfig


def leaf_space(leaf: Leaf) -> gymnasium.Space:
    """The gymnasium space of a box or discrete leaf (all the built-in envs use)."""
    if leaf.kind == "discrete":
        return gymnasium.spaces.Discrete(leaf.n, start=leaf.start)
    if leaf.kind != "box":
        raise TypeError(f"no gymnasium space for a {leaf.kind} leaf here")
    low, high = leaf_bounds(leaf)
    dtype = torch.empty((), dtype=leaf.dtype).numpy().dtype
    return gymnasium.spaces.Box(low.numpy().astype(dtype), high.numpy().astype(dtype), leaf.shape, dtype)


def _one_step(group: str, action: torch.Tensor) -> TensorDict:
    """Actions ``[1, A]`` of one env as a step TensorDict."""
    return TensorDict({group: TensorDict({ACTION: action}, batch_size=action.shape[:2])}, batch_size=[1])


class CartPoleGymEnv(gymnasium.Env):
    """One built-in CartPole as a ``gymnasium.Env`` (``Discrete(2)`` actions, ``Box(4,)`` observations)."""

    metadata = {"render_modes": []}

    def __init__(self, config: CartPoleConfig | None = None) -> None:
        self._env = CartPole(replace(config or CartPoleConfig(), num_envs=1))
        self._group = next(iter(groups(self._env.tree)))
        self.observation_space = leaf_space(self._env.tree.observation)
        self.action_space = leaf_space(self._env.tree.action)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        td = self._env.reset(seed=seed)
        return td.get((self._group, OBSERVATION))[0, 0].numpy().copy(), {}  # the env's state is viewed: ours

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        out = self._env.step(_one_step(self._group, torch.tensor([[int(action)]])))
        nxt = out.get(NEXT).get(self._group)
        flags = [bool(nxt.get(k)[0, 0, 0]) for k in (TERMINATED, TRUNCATED)]
        obs = nxt.get(OBSERVATION)[0, 0].numpy().copy()  # a view of the env's state: the caller may write into it
        return obs, float(nxt.get(REWARD)[0, 0, 0]), flags[0], flags[1], {}


class SpreadParallelEnv(ParallelEnv):
    """One built-in :class:`Spread` env as a PettingZoo ``ParallelEnv``.

    ``possible_agents`` are the slot names (``"agents_0"``...); ``agents`` are the ones present. A step's
    dicts hold the agents that acted (final observation for those that left) plus the ones that just joined
    (their first observation, reward 0, both flags False).
    """

    metadata = {"name": "shoal_spread_v0", "render_modes": []}

    def __init__(self, config: SpreadConfig | None = None) -> None:
        self._env = Spread(replace(config or SpreadConfig(), num_envs=1))
        spec = next(iter(groups(self._env.tree).values()))
        self._group = spec.name
        self.possible_agents = list(spec.agent_names)
        self.agents: list[str] = []
        self._obs_space = leaf_space(spec.agent.observation)
        self._act_space = leaf_space(spec.agent.action)
        self.state_space = leaf_space(shared_observations(self._env.tree)[()])
        self._state = np.zeros(self.state_space.shape, np.float32)

    @functools.lru_cache(maxsize=None)
    def observation_space(self, agent: str) -> gymnasium.Space:
        return self._obs_space

    @functools.lru_cache(maxsize=None)
    def action_space(self, agent: str) -> gymnasium.Space:
        return self._act_space

    def state(self) -> np.ndarray:
        return self._state.copy()

    def reset(self, seed: int | None = None, options: dict | None = None):
        td = self._env.reset(seed=seed)
        present = self._read_root(td)
        obs = td.get((self._group, OBSERVATION))[0]
        return {a: obs[i].numpy().copy() for a, i in present.items()}, {a: {} for a in present}

    def step(self, actions: dict):
        acting = {a: self.possible_agents.index(a) for a in self.agents}
        action = torch.zeros(1, len(self.possible_agents), dtype=torch.int64)
        for agent, a in actions.items():
            if agent in acting:
                action[0, acting[agent]] = int(a)
        out = self._env.step(_one_step(self._group, action))
        nxt = out.get(NEXT)
        ended = bool(nxt.get(DONE)[0, 0])
        group = nxt.get(self._group)
        obs = {a: group.get(OBSERVATION)[0, i].numpy().copy() for a, i in acting.items()}
        rew = {a: float(group.get(REWARD)[0, i, 0]) for a, i in acting.items()}
        term = {a: bool(group.get(TERMINATED)[0, i, 0]) for a, i in acting.items()}
        trunc = {a: bool(group.get(TRUNCATED)[0, i, 0]) for a, i in acting.items()}
        if ended:  # the batched env already started a new episode: hide it until reset()
            self.agents, self._state = [], nxt.get(SHARED)[0].numpy().copy()
            return obs, rew, term, trunc, {a: {} for a in acting}
        present = self._read_root(out)
        root_obs = out.get((self._group, OBSERVATION))[0]
        for agent, i in present.items():
            if agent not in acting:  # joined at this step
                obs[agent], rew[agent], term[agent], trunc[agent] = root_obs[i].numpy().copy(), 0.0, False, False
        return obs, rew, term, trunc, {a: {} for a in obs}

    def _read_root(self, td: TensorDict) -> dict[str, int]:
        mask = td.get((self._group, MASK))[0]
        present = {a: i for i, a in enumerate(self.possible_agents) if bool(mask[i])}
        self.agents = list(present)
        self._state = td.get(SHARED)[0].numpy().copy()
        return present


def as_gymnasium(config: CartPoleConfig | None = None) -> gymnasium.Env:
    """A single built-in CartPole as a ``gymnasium.Env`` (``config.num_envs`` is ignored)."""
    return CartPoleGymEnv(config)


def as_pettingzoo(config: SpreadConfig | None = None) -> ParallelEnv:
    """A single built-in :class:`Spread` env as a PettingZoo ``ParallelEnv`` (``config.num_envs`` is ignored)."""
    return SpreadParallelEnv(config)


__all__ = ["CartPoleGymEnv", "SpreadParallelEnv", "as_gymnasium", "as_pettingzoo", "leaf_space"]
