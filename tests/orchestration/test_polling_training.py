"""``rollout.env_polling`` through the one builder and Trainer, on both backends: every env process is a fragment
stream of its own, and the run's accounting counts each env step exactly once."""

from __future__ import annotations

import pytest

from orchestration.builder import build_trainer
from orchestration.config import RayConfig, RolloutConfig, TrainConfig


def _config(**kw) -> TrainConfig:
    return TrainConfig(env="CartPole-v1", iterations=2, seed=0,
                       rollout=RolloutConfig(num_envs=4, env_processes=2, env_polling=True, fragment_length=16), **kw)


def _train_until_both_streams_delivered(trainer, iterations: int = 8) -> dict:
    """At least two iterations, more (up to ``iterations``) until both env processes delivered a fragment: a
    polling actor lets the faster process go ahead, and on a loaded machine one can deliver every fragment of
    two iterations (CI saw it on Ray)."""
    for i in range(iterations):
        metrics = trainer.train()
        if i >= 1 and len({w for w, n in trainer.fleet.reported.items() if n}) == 2:
            break
    return metrics


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
        metrics = _train_until_both_streams_delivered(trainer)
        _check(trainer, metrics)
        assert metrics["env_steps"] >= 2 * trainer.config.steps_per_iteration
    finally:
        trainer.close()


@pytest.mark.ray
def test_polling_on_the_ray_backend_counts_every_stream(ray_session):
    trainer = build_trainer(_config(backend="ray", ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0)))
    try:
        metrics = _train_until_both_streams_delivered(trainer)
        _check(trainer, metrics)
    finally:
        trainer.close()


def test_polling_needs_processes_that_divide_the_envs():
    with pytest.raises(ValueError, match="env_polling needs env_processes >= 2 dividing num_envs"):
        RolloutConfig(num_envs=5, env_processes=2, env_polling=True)


# -- central inference (rollout.central_inference) ---------------------------------------------------------------
def _central(**kw) -> TrainConfig:
    return TrainConfig(env="builtin:cartpole", iterations=3, seed=0, lr=2.5e-3,
                       rollout=RolloutConfig(num_envs=8, fragment_length=32, num_workers=2, central_inference=True),
                       **kw)


def test_central_inference_on_the_local_backend_acts_with_the_learners_weights():
    trainer = build_trainer(_central())
    try:
        for _ in range(2):
            trainer.train()
        version, handed = trainer.learners["agent"].weights()  # what the next collect hands the actors
        metrics = trainer.train()
        service = trainer.fleet.actors[0].policies["agent"].service
        assert service.versions["agent"] == version
        assert service.stats()["served"] == 3 * 2 * 32  # every step of both actors, 3 iterations
        served = trainer.fleet.actor_weights("agent")  # every actor reads the one service's weights
        assert all((w[k] == handed[k]).all() for w in served for k in handed.keys(True, True))
        assert metrics["fragments_accepted"] == metrics["fragments_produced"] == 3 * 2
        assert metrics["trained_max_lag"] == 0
        assert not trainer.resume_exact  # the service's sampling stream is not in a checkpoint, as on Ray
    finally:
        trainer.close()


@pytest.mark.ray
def test_central_inference_on_the_ray_backend(ray_session):
    trainer = build_trainer(_central(backend="ray", ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0)))
    try:
        for _ in range(2):
            trainer.train()
        handed = trainer.learners["agent"].weights()[1]
        metrics = trainer.train()
        for served in trainer.fleet.actor_weights("agent"):  # every worker reads the one server's weights
            assert all((served[k] == handed[k]).all() for k in handed.keys(True, True))
        assert ray_session.get(trainer.fleet.inference.stats.remote())["served"] >= 3 * 2 * 32
        assert metrics["fragments_accepted"] == metrics["fragments_produced"]
        assert not trainer.resume_exact
    finally:
        trainer.close()
