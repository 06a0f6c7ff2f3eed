"""Actor: fragments whose log-probabilities are computed per fragment equal those computed step by step;
evaluation counts whole episodes, as many of each env."""

from __future__ import annotations

from functools import partial

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv

from adapters.gymnasium_env import GymnasiumVectorEnv
from core.layout import ACTION_PARAMS, LOG_PROB
from core.policies import make_policies
from orchestration.actor import Actor
from orchestration.assignment import assign
from orchestration.envs import make_env


def _fragments(env_name: str, num_envs: int, defer: bool, fragments: int = 2) -> list:
    env = make_env(env_name, num_envs)
    torch.manual_seed(0)
    policies = make_policies(env.tree)
    if not defer:  # the step-by-step path: as for heads that cannot recompute their log-probabilities
        for policy in policies.values():
            policy.defers_log_prob = False
    actor = Actor(env, policies, assign(env.tree), fragment_length=6, seed=3)
    out = [actor.collect() for _ in range(fragments)]
    env.close()
    return out


@pytest.mark.parametrize("env_name, num_envs", [("CartPole-v1", 4), ("pettingzoo:classic.connect_four_v3", 3)])
def test_fragment_log_probs_equal_the_step_by_step_ones(env_name, num_envs):
    """Real envs, a masked turn-based game among them: the same fragments, bit for bit, either way."""
    deferred, direct = _fragments(env_name, num_envs, True), _fragments(env_name, num_envs, False)
    for a, b in zip(deferred, direct):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        assert not any(ACTION_PARAMS in k for k in a.keys(True, True) if isinstance(k, tuple))
        for key in b.keys(True, True):
            assert torch.equal(a.get(key), b.get(key)), key
        assert any(k[-1] == LOG_PROB for k in a.keys(True, True) if isinstance(k, tuple))


class _Steps(gym.Env):
    """Episodes of ``length`` steps, reward 1 per step: an episode's return is its length."""

    observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, length: int) -> None:
        self.length, self.t = length, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), 1.0, self.t >= self.length, False, {}


def test_evaluation_counts_whole_episodes_and_every_env_alike():
    """An env whose episodes end sooner used to fill the count (4 episodes of 1 step, none of the 5-step env's),
    and a second evaluation counted the rest of an episode the first had left open (a return of 4, not 5)."""
    env = GymnasiumVectorEnv(SyncVectorEnv([partial(_Steps, 1), partial(_Steps, 5)]))
    actor = Actor(env, make_policies(env.tree), assign(env.tree), record=False, deterministic=True)
    assert sorted(actor.run_episodes(4)["return"]) == [1.0, 1.0, 5.0, 5.0]
    assert actor.run_episodes(1)["return"] == [1.0]  # the 5-step env's episode is left open after one step
    assert sorted(actor.run_episodes(3)["return"]) == [1.0, 1.0, 5.0]
    env.close()
