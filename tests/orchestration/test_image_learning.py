"""A conv policy learns the built-in image task (builtin:spot) within a fixed step budget and seed."""

from __future__ import annotations

import pytest

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig


@pytest.mark.slow
def test_the_nature_cnn_learns_in_which_quadrant_the_bright_pixel_is():
    # 12x12 grey images: the small Nature CNN (3x3 kernels, strides 1, 2, 1). Random answers score 0.25.
    config = TrainConfig(env="builtin:spot", seed=0, lr=2.5e-3, iterations=12, eval_every=12, eval_episodes=256,
                         policy=PolicyConfig(image_encoder="nature", image_features=64, hidden_sizes=(64,),
                                             activation="relu"),
                         rollout=RolloutConfig(num_envs=64, fragment_length=16),
                         ppo=PPOConfig(minibatch_size=256, num_epochs=4))
    trainer = build_trainer(config)
    assert "0" in trainer.learners["agent"].policy.actor_encoder.images  # the image leaf got a CNN
    returns = [trainer.train()["episode_return_mean"] for _ in range(config.iterations)]  # 12 x 1024 env steps
    greedy = trainer.evaluate()["eval_return_mean"]
    trainer.close()
    assert returns[-1] >= 0.6, f"hit rate by iteration: {[round(r, 2) for r in returns]}"
    assert greedy >= 0.8, f"greedy hit rate {greedy:.2f}"
