"""A torchrl env factory with a batch of its own, importable by name from any process (a Ray rollout worker
imports ``tests.adapters.own_batch_factories:make_serial`` as a user's ``package.module:factory``)."""

from __future__ import annotations


def make_serial(n: int = 3):
    """``n`` CartPoles in torchrl's ``SerialEnv``: ``n`` envs, whatever ``--rollout.num-envs`` says."""
    from torchrl.envs import GymEnv, SerialEnv

    return SerialEnv(n, lambda: GymEnv("CartPole-v1"))
