"""Episodes a fault cut (lenient mode: a repaired output, a restarted env process) train as truncated ones but
are not completed episodes: their partial returns stay out of the return statistics, on both backends, with
and without polling. The env: 5-step episodes of return 5, about half of them cut at their second step."""

from __future__ import annotations

import pytest

from core.losses import PPOConfig
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig

ENV = "tests.orchestration.faulty_env_factories:make_five_steps"


def _metrics(fault: str, backend: str = "local", eval_every: int = 0, **rollout) -> dict:
    config = TrainConfig(env=ENV, env_kwargs=(("fault", repr(fault)),), backend=backend, iterations=2,
                         eval_every=eval_every, eval_episodes=8,
                         ppo=PPOConfig(minibatch_size=64, num_epochs=1),
                         rollout=RolloutConfig(num_envs=4, fragment_length=20, check="lenient", **rollout))
    trainer = build_trainer(config)
    try:
        totals: dict[str, float] = {}
        for _ in range(2):
            metrics = trainer.train()
            totals["episodes"] = totals.get("episodes", 0) + metrics["episodes"]
        return {**metrics, **totals}
    finally:
        trainer.close()


@pytest.mark.parametrize("fault, rollout, counter", [
    ("nan", {}, "env/invalid_output_truncations"),
    ("raise", {}, "env/episodes_lost"),
    ("raise", {"env_processes": 2, "env_polling": True}, "env/episodes_lost"),
    ("final_obs", {}, "env/invalid_output_truncations"),
], ids=["repaired", "restarted", "restarted_polled", "whole_but_repaired"])
def test_cut_episodes_are_counted_but_not_averaged_into_the_returns(fault, rollout, counter):
    metrics = _metrics(fault, **rollout)
    assert metrics[counter] > 0  # repairs or restarts happened
    assert metrics["episodes"] > 0 and metrics["episode_return_mean"] == 5.0 and metrics["episode_length_mean"] == 5.0
    if fault == "final_obs":  # every episode ended by the env with its rewards: all 2 x 4 x 20 / 5 of them count
        assert metrics["episodes"] == 32


@pytest.mark.ray
def test_cut_episodes_stay_out_of_the_returns_on_ray_too(ray_session):
    metrics = _metrics("raise", backend="ray", num_workers=1)
    assert metrics["env/episodes_lost"] > 0
    assert metrics["episodes"] > 0 and metrics["episode_return_mean"] == 5.0


def test_evaluations_score_whole_episodes_and_count_their_envs_faults():
    """The evaluation envs' repairs were counted nowhere (a new user's faults did not add up)."""
    metrics = _metrics("nan", eval_every=1)
    assert metrics["eval_return_mean"] == 5.0 and metrics["eval_env/invalid_output_truncations"] > 0
