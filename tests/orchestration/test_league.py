"""A league trainer drives a sub-trainer: frozen opponents from a growing pool, drawn by PFSP."""

from __future__ import annotations

import pytest
from tensordict import TensorDict

from core.losses import PPOConfig
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.league import LeagueTrainer
from orchestration.builder import build_trainer


@pytest.mark.slow
def test_league_grows_a_pool_and_actors_play_the_drawn_opponent():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=6, lr=1e-3,
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",),
                         rollout=RolloutConfig(num_envs=8, fragment_length=32), ppo=PPOConfig(minibatch_size=128))
    league = LeagueTrainer(build_trainer(config), learner="player", opponent="opponent", snapshot_every=2)
    draws = []
    for _ in range(6):
        metrics = league.train()
        draws.append(metrics["league_opponent"])
        actor_opponent = TensorDict.from_module(league.trainer.fleet.actors[0].policies["opponent"])
        assert (actor_opponent == league.current.weights).all()  # the actors played the drawn member
    assert len(league.pool) == 4 and metrics["league_size"] == 4  # initial + snapshots at 2, 4, 6
    assert sum(m.games for m in league.pool) > 0
    # Elo (core.ratings): reported, and moving towards whoever wins
    assert metrics["league_elo"] == league.rating and metrics["league_opponent_elo"] == league.current.rating
    initial = league.pool[0]
    if initial.games:  # the learner beat the random-initialised opponent more often than not: it gained on it
        assert (league.rating > initial.rating) == (initial.win_rate > 0.5) or initial.win_rate == 0.5
    learner_now = TensorDict.from_module(league.trainer.learners["player"].policy)
    assert not (learner_now == league.pool[1].weights).all()  # snapshots are copies, not views


def test_league_refuses_a_learning_opponent():
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", iterations=1,
                         rollout=RolloutConfig(num_envs=2, fragment_length=8))
    trainer = build_trainer(config)
    with pytest.raises(ValueError, match="fixed policy"):
        LeagueTrainer(trainer, learner="player", opponent="player")
