"""Env factories whose data breaks their tree, importable by name from any process (a Ray rollout worker imports
``tests.orchestration.faulty_env_factories:make_wrong_shape`` as a user's ``package.module:factory``)."""

from __future__ import annotations

import gymnasium


class _Shorter(gymnasium.Wrapper):
    """Its steps (not its reset) drop the observation's last entry: found at the first step, not at the probe."""

    def step(self, action):
        obs, *rest = self.env.step(action)
        return (obs[:-1], *rest)


def make_wrong_shape():
    return _Shorter(gymnasium.make("CartPole-v1"))
