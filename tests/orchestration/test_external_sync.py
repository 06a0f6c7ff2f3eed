"""Synchronous mode with external simulators, on both backends: every iteration trains on exactly
``train_batch_size`` env steps acted by the weights of that iteration. Simulators cannot be made to wait while
the learner trains; what they did meanwhile was acted by older weights: stale, dropped and counted, never
folded into the next batch (on Ray, where the learner trains in another process, that was 2-3 batches)."""

from __future__ import annotations

import pytest

from orchestration.config import ExternalConfig, RayConfig, RolloutConfig, TrainConfig
from orchestration.run_loop import env_faults

from .test_external_server import MEASURED_WITH, SIM

BATCH = 256


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_sync_trains_exactly_one_batch_of_fresh_steps_per_iteration(backend, request, tmp_path):
    from orchestration.builder import build_trainer

    if backend == "ray":
        request.getfixturevalue("ray_session")
    config = TrainConfig(env="external", iterations=4, seed=0, backend=backend, mode="sync", **MEASURED_WITH,
                         rollout=RolloutConfig(num_envs=1, fragment_length=16), train_batch_size=BATCH,
                         run_dir=str(tmp_path), ray=RayConfig(learner_num_cpus=0, learner_num_gpus=0),
                         external=ExternalConfig(command=SIM, instances=2, start_timeout_s=60))
    trainer = build_trainer(config)
    trained, faults = [], []
    try:
        for _ in range(config.iterations):
            metrics = trainer.train()
            trained.append(metrics["env_steps_trained"])
            assert metrics["trained_max_lag"] == 0  # no fragment acted by an older version was trained on
            faults.append((env_faults(metrics), metrics["env/external_requests"]))
        accounting = trainer.accounting()
    finally:
        trainer.close()
    assert [b - a for a, b in zip([0, *trained], trained)] == [BATCH] * config.iterations
    assert accounting["fragments_produced"] == accounting["fragments_accepted"] + accounting["fragments_stale"] + \
        accounting["fragments_lost"] + accounting["fragments_in_flight"]
    assert accounting["fragments_accepted"] == config.iterations * BATCH // 16
    assert faults[-1][0] == 0 < faults[-1][1], faults  # a healthy run's traffic is not shown as env faults
