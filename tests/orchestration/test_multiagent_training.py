"""Multi-agent learning by step budget and seed: a masked AEC game against a random opponent, mpe2 spread."""

from __future__ import annotations

import dataclasses

import pytest

from core.losses import PPOConfig
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.builder import build_trainer


@pytest.mark.slow
def test_connect_four_never_plays_illegal_moves_and_beats_a_random_opponent():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=24, lr=1e-3, anneal_lr=False,
                         eval_every=24, eval_episodes=100, policy_mapping=(("player_1", "random"),),
                         rollout=RolloutConfig(num_envs=16, fragment_length=64),
                         ppo=PPOConfig(minibatch_size=256, entropy_coef=0.01))
    trainer = build_trainer(config)
    sent: list[tuple[int, int]] = []
    for env_index, copy in enumerate(trainer.fleet.actors[0].env.envs):  # record every move the raw envs receive
        raw_step = copy.step

        def recording_step(action, copy=copy, raw_step=raw_step):
            if action is not None:
                legal = copy.observe(copy.agent_selection)["action_mask"]
                sent.append((int(action), int(legal[int(action)])))
            return raw_step(action)

        copy.step = recording_step
    before = trainer.evaluate(100)["eval_return_mean/player"]
    for _ in range(config.iterations):  # 24 x 1024 = 24,576 moves (about half by the learner)
        metrics = trainer.train()
    assert sent and all(legal == 1 for _, legal in sent), "an illegal move reached the environment"
    wins = (metrics["eval_return_mean/player"] + 1) / 2  # +1 win, -1 loss, 0 draw
    assert metrics["eval_return_mean/player"] > before + 0.15, (before, metrics["eval_return_mean/player"])
    assert wins > 0.8, f"win rate against a random opponent {wins:.2f}"


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["local", "central", "joint"])
def test_simple_spread_beats_a_random_policy(critic):
    from core.policies import PolicyConfig

    config = TrainConfig(env="mpe2:simple_spread_v3", seed=0, iterations=20, lr=1e-3, eval_every=20,
                         eval_episodes=64, env_kwargs=(("max_cycles", "25"),),
                         rollout=RolloutConfig(num_envs=16, fragment_length=50),
                         ppo=PPOConfig(minibatch_size=200, gamma=0.95),
                         policy=PolicyConfig(critic=critic))
    uniform = dataclasses.replace(config, policy_mapping=tuple((f"agent_{i}", "random") for i in range(3)))
    random_return = build_trainer(uniform).evaluate(64)["eval_return_mean"]  # uniformly random actions
    trainer = build_trainer(config)
    for _ in range(config.iterations):  # 20 x 800 = 16,000 env steps (48,000 agent steps)
        metrics = trainer.train()
    print(critic, random_return, metrics["eval_return_mean"])
    assert metrics["eval_return_mean"] > random_return + 0.1 * abs(random_return), (random_return, metrics)
