"""A learner hosted in its own process, without Ray (:mod:`orchestration.learner_host`): the calls a driver
makes, with the transport injected. The Ray server (``test_ray_backend``) is this host on ``ray.put``/``ray.get``."""

from __future__ import annotations

from tensordict import TensorDict

from core.specs import to_json
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.learner_host import LearnerHost
from orchestration.wire import from_wire, to_wire


def _setup():
    config = TrainConfig(env="builtin:cartpole", seed=0, loggers=(), train_batch_size=128,
                         rollout=RolloutConfig(num_envs=4, fragment_length=32))
    trainer = build_trainer(config)
    actor, (pid, local) = trainer.fleet.actors[0], next(iter(trainer.trainable.items()))
    puts: list[dict] = []
    host = LearnerHost(pid, config, to_json(trainer.tree), to_wire(local.published()[1]),
                       put=lambda message: puts.append(message) or len(puts) - 1)
    return trainer, actor, local, host, puts


def test_a_host_trains_as_the_local_learner_and_puts_each_version_once():
    trainer, actor, local, host, puts = _setup()
    try:
        host.publish()
        assert host.published() == (0, [0]) and puts[0]["meta"] == {"version": 0, "policy_id": local.policy_id}
        for _ in range(2):
            fragment = actor.collect()
            meta = actor.fragment_meta(fragment)
            local.receive(fragment, meta)
            host.push(meta, lambda message=to_wire(fragment, meta): message)
            assert host.new_steps() == fragment.batch_size.numel()  # filed, not trained yet
            expected = local.submit(0.5, 1e-3, take_all=True).result()
            result = host.train(0.5, 1e-3, take_all=True)
            assert result["version"] == expected["version"] and result["fragment_ids"] == expected["fragment_ids"]
            assert result["metrics"] == expected["metrics"]
            assert result["weights"] == [len(puts) - 1] and host.published() == (result["version"], result["weights"])
            weights = from_wire(puts[-1])
            assert (weights == TensorDict.from_module(local.policy)).all()  # the message holds the new version
        assert len(puts) == 3 and host.learner.counters["serializations"] == 3  # version 0, 1, 2: one put each
        assert host.train() is None and len(puts) == 3  # nothing new: no update, nothing put
    finally:
        trainer.close()


def test_a_re_delivery_is_never_fetched_and_an_unreadable_one_is_counted_lost():
    trainer, actor, _, host, _ = _setup()
    try:
        fetched = []

        def fetch(message):
            fetched.append(message["meta"]["sequence"])
            return message

        first = actor.collect()
        meta = actor.fragment_meta(first)
        host.push(meta, lambda: fetch(to_wire(first, meta)))
        host.push(meta, lambda: fetch(to_wire(first, meta)))  # the same delivery again
        assert fetched == [meta["sequence"]] and host.learner.inbox.counters["duplicates"] == 1

        second = actor.collect()
        host.push(actor.fragment_meta(second), lambda: (_ for _ in ()).throw(TimeoutError("object lost")))
        totals = host.report()["totals"]
        assert totals["lost"] == 1 and totals["accepted"] == 1 and host.learner.counters["fragments_received"] == 3
        assert [e.fragment.get("fragment_id")[0, 0] for e in host.learner.inbox.pool.values()] == \
            [first.get("fragment_id")[0, 0]]  # only the first was filed
    finally:
        trainer.close()


def test_a_restarted_host_resumes_the_registered_state_and_its_versions_go_on_rising():
    trainer, actor, local, host, puts = _setup()
    try:
        fragment = actor.collect()
        meta = actor.fragment_meta(fragment)
        host.push(meta, lambda: to_wire(fragment, meta))
        host.train(take_all=True)
        saved = host.state()  # what the driver registered, at version 1
        host.push(meta := actor.fragment_meta(second := actor.collect()), lambda: to_wire(second, meta))
        host.train(take_all=True)  # version 2, published and then lost with the process

        again = LearnerHost(local.policy_id, trainer.config, to_json(trainer.tree), to_wire(local.published()[1]))
        again.resume_from(restarts=1, state=saved, version=2)
        assert again.restored_version == 1 and again.learner.version == 3  # past what any worker saw
        assert (TensorDict.from_module(again.learner.policy) == from_wire(puts[1])).all()  # version 1's weights
        assert again.report()["restarts"] == 1

        fresh = LearnerHost(local.policy_id, trainer.config, to_json(trainer.tree), to_wire(local.published()[1]))
        fresh.resume_from(restarts=2, state=None, version=5)  # died before its first registration
        assert fresh.restored_version is None and fresh.learner.version == 6
    finally:
        trainer.close()
