"""``PPOLearner.run``: the continuous loop of a learner fed from a stream of fragments (seed 002)."""

from __future__ import annotations

import torch

from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig


def _stream(n: int):
    """A learner whose batch is one fragment ``[4, 32]``, and ``n`` fragments collected by the run's actor."""
    config = TrainConfig(env="builtin:cartpole", iterations=1, loggers=(),
                         rollout=RolloutConfig(num_envs=4, fragment_length=32))
    trainer = build_trainer(config)
    fragments = [trainer.fleet.actors[0].collect() for _ in range(n)]
    (_, learner), = trainer.trainable.items()
    return trainer, learner, fragments


def test_run_trains_once_per_ready_batch_and_stops_where_told():
    trainer, learner, fragments = _stream(7)
    try:
        before = learner.weights()[1].clone()
        reports = list(learner.run(iter(fragments[:4])))
        assert [r["version"] for r in reports] == [1.0, 2.0, 3.0, 4.0]  # one update per 128-step fragment
        assert learner.counters["env_steps_trained"] == 4 * 128
        assert any(not torch.equal(before[k], v) for k, v in learner.weights()[1].items(True, True))
        # until() stops the loop at the update that satisfies it; the rest of the stream is not read
        # a re-delivered fragment is ignored (never trained on twice)
        assert list(learner.run(iter([fragments[0]]))) == [] and learner.version == 4
        rest = iter(fragments[4:])
        stopped = list(learner.run(rest, until=lambda m: m["version"] >= 5))
        assert [r["version"] for r in stopped] == [5.0] and len(list(rest)) == 2
    finally:
        trainer.close()


def test_update_through_takes_each_batch_and_the_last_batch_is_kept_only_when_asked():
    """A data-parallel rank 0 trains through ``update_through`` (the Ray learner splits the batch there); the
    batch's entries stay in ``last_batch`` only with ``keep_last_batch`` (they pin the fragments)."""
    trainer, learner, fragments = _stream(3)
    try:
        learner.receive(fragments[0])
        learner.train()
        assert learner.last_batch == [] and learner.last_fragment_ids
        seen = []
        learner.update_through = lambda frags, progress, team: seen.append((frags, progress, team)) or {"x": 1.0}
        learner.keep_last_batch = True
        learner.receive(fragments[1])
        assert learner.train(0.25) == {"x": 1.0}
        (frags, progress, team), = seen
        assert [f is fragments[1] for f in frags] == [True] and progress == 0.25 and team is None
        assert [e.fragment for e in learner.last_batch] == [fragments[1]]
        assert learner.version == 1  # the hook did the update: update_ never ran
    finally:
        trainer.close()
