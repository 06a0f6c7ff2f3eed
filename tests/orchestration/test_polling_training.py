"""``rollout.env_polling`` through the one builder and Trainer, on both backends: every env process is a fragment
stream of its own, and the run's accounting counts each env step exactly once."""

from __future__ import annotations

import pytest

from orchestration.builder import build_trainer
from orchestration.config import RayConfig, RolloutConfig, TrainConfig


def _config(**kw) -> TrainConfig:
    return TrainConfig(env="CartPole-v1", iterations=2, seed=0,
                       rollout=RolloutConfig(num_envs=4, env_processes=2, env_polling=True, fragment_length=16), **kw)


def _check(trainer, metrics) -> None:
    produced = metrics["fragments_produced"]
    assert produced == metrics["fragments_accepted"] + metrics["fragments_stale"] + metrics["fragments_lost"] + \
        metrics["fragments_in_flight"]
    assert trainer.fleet.fragment_steps == 2 * 16  # one process's 2 envs, not the actor's 4
    assert metrics["env_steps"] == produced * 2 * 16
    streams = {w for w, n in trainer.fleet.reported.items() if n}
    assert len(streams) == 2  # both processes delivered, each under its own worker id


def test_polling_on_the_local_backend_counts_every_stream():
    trainer = build_trainer(_config())
    try:
        for _ in range(2):
            metrics = trainer.train()
        _check(trainer, metrics)
        assert metrics["env_steps"] >= 2 * trainer.config.steps_per_iteration
    finally:
        trainer.close()


@pytest.mark.ray
def test_polling_on_the_ray_backend_counts_every_stream(ray_session):
    trainer = build_trainer(_config(backend="ray", ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0)))
    try:
        for _ in range(2):
            metrics = trainer.train()
        _check(trainer, metrics)
    finally:
        trainer.close()


def test_polling_needs_processes_that_divide_the_envs():
    with pytest.raises(ValueError, match="env_polling needs env_processes >= 2 dividing num_envs"):
        RolloutConfig(num_envs=5, env_processes=2, env_polling=True)
