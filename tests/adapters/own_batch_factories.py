"""A torchrl env factory with a batch of its own, importable by name from any process (a Ray rollout worker
imports ``tests.adapters.own_batch_factories:make_three`` as a user's ``package.module:factory``)."""

from __future__ import annotations


def make_three():
    """Three CartPoles in torchrl's ``SerialEnv``: 3 envs, whatever ``--rollout.num-envs`` says."""
    from torchrl.envs import GymEnv, SerialEnv

    return SerialEnv(3, lambda: GymEnv("CartPole-v1"))
