"""Recurrent policies learn the built-in memory task (builtin:recall) by truncated BPTT; feed-forward ones cannot.

Recall shows one of 4 cues at an episode's first step and asks for it 4 steps later: a policy without memory
scores 1/4 at best, one that carries the cue scores 1. Fixed step budget and seed; greedy evaluation.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.builder import build_trainer
from orchestration.config import RayConfig, RolloutConfig, TrainConfig

CUES = (("num_cues", "4"), ("delay", "4"))


def _config(recurrent: bool, **fields) -> TrainConfig:
    policy = PolicyConfig(recurrent=recurrent, recurrent_critic=recurrent, recurrent_size=32, hidden_sizes=(32,))
    config = TrainConfig(env="builtin:recall", env_kwargs=CUES, seed=0, lr=3e-3, iterations=30, eval_every=30,
                         eval_episodes=128, policy=policy, rollout=RolloutConfig(num_envs=32, fragment_length=20),
                         ppo=PPOConfig(minibatch_size=160, num_epochs=4, entropy_coef=0.01))
    return dataclasses.replace(config, **fields)


def _train_and_evaluate(config: TrainConfig) -> tuple[list[float], float]:
    trainer = build_trainer(config)
    try:
        returns = [trainer.train()["episode_return_mean"] for _ in range(config.iterations)]  # 30 x 640 steps
        return returns, trainer.evaluate()["eval_return_mean"]
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_recurrent_policy_remembers_the_cue_and_a_feed_forward_one_cannot():
    returns, greedy = _train_and_evaluate(_config(True))
    assert greedy >= 0.9, f"recurrent: greedy hit rate {greedy:.2f}; by iteration {[round(r, 2) for r in returns]}"
    returns, greedy = _train_and_evaluate(_config(False))
    assert greedy <= 0.45, f"feed-forward: greedy hit rate {greedy:.2f} (chance 0.25)"


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_sequence_length_and_burn_in_train_the_same_task(cell):
    # Chunks of 5 steps (one episode each when aligned) with 3 burn-in steps: still every step trained once.
    config = _config(True, iterations=1, policy=PolicyConfig(recurrent=True, recurrent_cell=cell, recurrent_critic=True,
                                                             recurrent_size=16, hidden_sizes=(16,)),
                     ppo=PPOConfig(minibatch_size=40, num_epochs=1, sequence_length=5, burn_in=3))
    trainer = build_trainer(config)
    try:
        before = trainer.learners["agent"].weights()[1].clone()
        metrics = trainer.train()
        after = trainer.learners["agent"].weights()[1]
    finally:
        trainer.close()
    assert metrics["num_minibatches"] == 640 // 40  # 128 sequences of 5 trained steps, 8 per minibatch
    cell_weights = [k for k in after.keys(True, True) if cell in "".join(k)]
    assert cell_weights and all(not torch.equal(before[k], after[k]) for k in cell_weights)


@pytest.mark.ray
def test_recurrent_policies_train_on_the_ray_backend(ray_session):
    config = _config(True, iterations=2, backend="ray", ray=RayConfig(learner_num_cpus=0, learner_num_gpus=0))
    trainer = build_trainer(config)
    try:
        metrics = [trainer.train() for _ in range(2)]
        greedy = trainer.evaluate(16)["eval_return_mean"]
    finally:
        trainer.close()
    assert all(m["env_steps_trained"] > 0 if "env_steps_trained" in m else True for m in metrics)
    assert metrics[-1]["num_minibatches"] == 640 // 160 * 4
    assert 0.0 <= greedy <= 1.0
