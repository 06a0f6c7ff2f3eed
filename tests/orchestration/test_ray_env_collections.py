"""Environment collections on the Ray backend (issue 14): rollout workers get their member with each call,
every fragment names its env id, per-env metrics and curriculum promotion come out as locally, and so do an
adversarial set's draws, a prior's parameters and a split's evaluation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from orchestration.builder import build_trainer
from orchestration.config import RayConfig
from orchestration.wire import wire_meta
from tests.orchestration.test_env_collections import FORMAT, cartpole, config, curriculum, prior, run

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


ADVERSARIAL = {"format": FORMAT, "members": {"short": cartpole(5), "long": cartpole(500)},
               "structure": {"kind": "adversarial", "ids": ["short", "long"], "temperature": 0.25}}
SPLIT = {"format": FORMAT, "members": {"a": cartpole(40), "b": cartpole(60), "test": cartpole(100)},
         "structure": {"kind": "split", "train": ["a", "b"], "test": ["test"]}}


@pytest.mark.parametrize("which", ["adversarial", "prior", "split"])
def test_the_other_structures_on_ray_draw_measure_and_evaluate_as_locally(ray_session, which):
    """An adversarial set (its draws follow the returns the workers report), a prior (parameters drawn per episode
    in the workers' envs) and a split (evaluation on the test envs only): a synchronous Ray run's per-env metrics
    and members equal the local run's, iteration by iteration."""
    doc = {"adversarial": json.dumps(ADVERSARIAL), "prior": prior(), "split": json.dumps(SPLIT)}[which]
    cfg = config(doc, backend="ray", ray=RAY, eval_every=2 if which == "split" else 0, eval_episodes=2)
    local, remote = run(dataclasses.replace(cfg, backend="local"), 3), []
    trainer = build_trainer(cfg)
    try:
        for _ in range(3):
            remote.append((trainer.train(), list(trainer.envsets.assigned)))
    finally:
        trainer.close()
    for (expected, members, _), (got, assigned) in zip(local, remote, strict=True):
        assert assigned == members
        keys = [k for k in expected if "env:" in k or k.startswith(("collection/", "eval_return_mean"))]
        assert keys and any(k.startswith({"adversarial": "collection/prob/", "prior": "collection/param/",
                                          "split": "episodes/env:test"}[which]) for k in keys)
        for key in keys:
            assert got[key] == expected[key] or (math.isnan(got[key]) and math.isnan(expected[key])), key


def test_streaming_ray_workers_switch_members_at_their_next_fragment(ray_session):
    """Asynchronous mode on Ray: a streaming worker gets each new member while it runs and switches at its next
    fragment boundary, so every fragment names a member its worker was given, and the promoted stage's
    fragments arrive (as the local test of async switching checks for local actors)."""
    cfg = config(curriculum(0.5), backend="ray", ray=RAY, mode="async", max_staleness=4, train_batch_size=128)
    trainer = build_trainer(cfg)
    given: list[set[str]] = [set() for _ in range(cfg.rollout.num_workers)]  # slot -> members it was given
    trained_on: set[str] = set()
    try:
        for _ in range(16):  # a step budget: the promoted stage's fragments queue behind older ones
            metrics = trainer.train()  # draws the members first, then trains on the oldest fresh fragments
            for slot, member in enumerate(trainer.envsets.assigned):
                given[slot].add(member)
            batch = ray_session.get(trainer.learners["agent"].handle.last_batch.remote())
            metas = [wire_meta(msg) for msg in batch]
            assert metas and all(m["env_id"] in given[m["worker_id"] & 0xFFFF] for m in metas)
            assert metrics["episodes/env:easy"] + metrics["episodes/env:hard"] == metrics["episodes"]
            trained_on |= {m["env_id"] for m in metas}
            if "hard" in trained_on:
                break
    finally:
        trainer.close()
    assert "hard" in trained_on, "no fragment of the promoted stage was trained on"


def test_set_env_ids_on_ray_without_a_collection_is_refused_at_the_call(ray_session):
    """As on the local backend: the fleet says so when called (the worker's error came at its next collect)."""
    from orchestration.config import RolloutConfig, TrainConfig

    trainer = build_trainer(TrainConfig(env="builtin:cartpole", backend="ray",
                                        rollout=RolloutConfig(num_envs=2, fragment_length=4)))
    try:
        with pytest.raises(ValueError, match=r"this run's env \(builtin:cartpole\) is not a collection"):
            trainer.fleet.set_env_ids(["easy"])
    finally:
        trainer.close()
