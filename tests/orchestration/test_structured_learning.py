"""PPO learns the built-in two-stage task (builtin:pick: choose a node, then a transformation legal for it, which
the env skips on some steps) within a fixed step budget and seed."""

from __future__ import annotations

import pytest

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig


def test_ppo_learns_the_two_stage_pick_task():
    # A random legal policy scores ~0.5 per step, the best one 1.5 (1 for the good node, 1 for its preferred
    # transformation on the half of the steps that execute it).
    config = TrainConfig(env="builtin:pick", seed=0, lr=3e-3, iterations=8, eval_every=8, eval_episodes=256,
                         policy=PolicyConfig(hidden_sizes=(64,)),
                         rollout=RolloutConfig(num_envs=64, fragment_length=16),
                         ppo=PPOConfig(minibatch_size=256, num_epochs=4))
    trainer = build_trainer(config)
    policy = trainer.learners["agent"].policy
    assert policy.heads.structured and policy.heads.sizes == [4, 12]  # node logits, then a [4, 3] logits table
    returns = [trainer.train()["episode_return_mean"] for _ in range(config.iterations)]  # 8 x 1024 env steps
    greedy = trainer.evaluate()["eval_return_mean"]
    trainer.close()
    assert returns[0] < 0.8, f"return by iteration: {[round(r, 2) for r in returns]}"
    assert returns[-1] >= 1.1, f"return by iteration: {[round(r, 2) for r in returns]}"
    assert greedy >= 1.35, f"greedy return {greedy:.2f}"


@pytest.mark.ray
def test_structured_actions_train_on_the_ray_backend(ray_session):
    """The mask tree (per-leaf masks, the conditional table, presence) travels in fragments from Ray rollout
    workers to a Ray learner, which learns: a random legal policy scores about 0.56 per step."""
    from orchestration.config import RayConfig

    config = TrainConfig(env="builtin:pick", seed=0, lr=3e-3, iterations=3, backend="ray",
                         ray=RayConfig(learner_num_cpus=0, learner_num_gpus=0))
    trainer = build_trainer(config)
    try:
        returns = [trainer.train()["episode_return_mean"] for _ in range(config.iterations)]
    finally:
        trainer.close()
    assert returns[-1] > 0.75, returns
