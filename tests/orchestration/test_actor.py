"""Actor: fragments whose log-probabilities are computed per fragment equal those computed step by step."""

from __future__ import annotations

import pytest
import torch

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
