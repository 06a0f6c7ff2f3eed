"""Environment collections on the Ray backend (issue 14): rollout workers get their member with each call,
every fragment names its env id, per-env metrics and curriculum promotion come out as locally."""

from __future__ import annotations

import dataclasses

import pytest

from orchestration.builder import build_trainer
from orchestration.config import RayConfig
from orchestration.wire import wire_meta
from tests.orchestration.test_env_collections import config, curriculum, run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = RayConfig(worker_num_cpus=0, learner_num_cpus=0)


def test_a_collection_on_ray_produces_fragments_with_env_ids_and_per_env_metrics(ray_session):
    cfg = config(curriculum(0.5), backend="ray", ray=RAY)
    local = [metrics for metrics, _, _ in run(dataclasses.replace(cfg, backend="local"), 3)]
    trainer = build_trainer(cfg)
    try:
        for iteration in range(3):
            metrics = trainer.train()
            assigned = list(trainer.envsets.assigned)
            batch = ray_session.get(trainer.learners["agent"].handle.last_batch.remote())
            metas = [wire_meta(msg) for msg in batch]
            assert metas and all(m["env_id"] == assigned[m["worker_id"] & 0xFFFF] for m in metas)
            assert metrics["collection/fragments/env:easy"] + metrics["collection/fragments/env:hard"] == len(metas)
            # a synchronous Ray run reproduces the local one: same draws, same per-env episodes, same promotion
            for key in ("episodes/env:easy", "episodes/env:hard", "collection/unlocked/env:hard",
                        "collection/actors/env:hard", "collection/switch_truncations"):
                assert metrics[key] == local[iteration][key], key
        assert metrics["collection/unlocked/env:hard"] == 1.0
    finally:
        trainer.close()
