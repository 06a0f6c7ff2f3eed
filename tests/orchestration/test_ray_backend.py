"""The Ray backend against the local one, and under staleness and faults (one session-wide Ray instance).

- parity: the same synchronous run on both backends gives the same fragments and the same weights;
- learner inbox: duplicate deliveries are ignored, stale data never enters the pool;
- staleness: with one slow worker nothing older than ``max_staleness`` is trained on, drops are counted;
- chaos: workers killed during a streaming run are re-created, a killed learner resumes from its last
  checkpoint; every produced fragment is accepted, stale or lost (exact accounting); no fragment is
  trained twice;
- Tune: trials of a parameter grid run as parallel experiments (skipped without ``ray[tune]``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import ray
import torch
from tensordict import TensorDict

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.config import CuriosityConfig, RayConfig, RolloutConfig, TrainConfig
from orchestration.wire import from_wire, to_wire

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENV = "builtin:cartpole"


def _config(**kw) -> TrainConfig:
    rollout = RolloutConfig(num_envs=4, fragment_length=16, num_workers=2)
    ray = RayConfig(worker_num_cpus=0, learner_num_cpus=0)  # 2 shared cores: no reservations
    return TrainConfig(**{"env": ENV, "iterations": 20, "rollout": rollout, "ray": ray, **kw})


def _ray(config: TrainConfig):
    from orchestration.builder import build_trainer

    return build_trainer(dataclasses.replace(config, backend="ray"))


def _identity(acc: dict) -> bool:
    return (acc["fragments_accepted"] + acc["fragments_stale"] + acc["fragments_lost"] + acc["fragments_in_flight"]
            == acc["fragments_produced"])


# Several learners: builtin:spread's four agents split between two trained policies and a fixed random one, with
# MAPPO's critic run once per env (critic="joint": its input holds every agent's observation and the shared state).
SPLIT = {"env": "builtin:spread", "policy_mapping": (("agents_1", "other"), ("agents_2", "random")),
         "eval_every": 2, "eval_episodes": 2, "policy": PolicyConfig(critic="joint")}


# What the policies bring (seed 001's policies issue), on an image task and a memory task: an image encoder with
# reward scaling; an LSTM trained on sequences with a burn-in, its observations normalised (the statistics are
# part of the weights the workers get); MAPPO's central critic (every agent's critic sees the whole state).
IMAGES = {"env": "builtin:spot", "policy": PolicyConfig(image_encoder="impala", image_features=32, scale_rewards=True)}
MEMORY = {"env": "builtin:recall", "ppo": PPOConfig(sequence_length=8, burn_in=4, minibatch_size=32),
          "policy": PolicyConfig(recurrent=True, recurrent_cell="lstm", normalize_observations=True)}
CENTRAL = {"env": "builtin:spread", "policy": PolicyConfig(critic="central", normalize_observations=True)}
CONTINUOUS = {"env": "Pendulum-v1"}  # a Gaussian head on a bounded box action (gymnasium's vector env)
TORCHRL = {"env": "torchrl:CartPole-v1"}  # building its envs draws from torch's generator (not the weights')
CURIOSITY = {"curiosity": CuriosityConfig(coef=0.1)}  # the RND bonus, its predictor and statistics in the learner
FIXED = {"env": "builtin:spread", "policy_mapping": (("agents_1", "frozen"),),  # --fixed-policies: acts, never
         "fixed_policies": ("frozen",)}                                            # trains, is checkpointed
MASKED = {"env": "Taxi-v4", "env_kwargs": (("max_episode_steps", "10"),)}  # gymnasium masks from info


@pytest.mark.parametrize("overrides", [{}, SPLIT, IMAGES, MEMORY, CENTRAL, CONTINUOUS, TORCHRL, CURIOSITY, FIXED,
                                       MASKED],
                         ids=["cartpole", "spread_3_policies", "images_scaled_rewards", "lstm_burn_in_normalised",
                              "central_critic", "continuous_actions", "torchrl_env", "curiosity", "fixed_policy",
                              "gymnasium_masks"])
def test_sync_ray_matches_local_fragments_weights_and_metrics(ray_session, overrides):
    from orchestration.builder import build_trainer

    config = _config(**overrides)
    local = build_trainer(config)
    trained = local.trainable
    received: dict[str, list[TensorDict]] = {pid: [] for pid in trained}
    for pid, learner in trained.items():
        receive = learner.receive
        learner.receive = lambda fragment, meta=None, pid=pid, receive=receive: (
            received[pid].append(fragment.clone()), receive(fragment, meta))
    remote = _ray(config)
    try:
        assert sorted(remote.trainable) == sorted(trained)  # one learner actor per trained policy
        for _ in range(3 if not overrides else 2):
            for fragments in received.values():
                fragments.clear()
            local_metrics, ray_metrics = local.train(), remote.train()
            for pid, learner in trained.items():
                batch = [from_wire(m) for m in ray_session.get(remote.learners[pid].handle.last_batch.remote())]
                assert [int(f["fragment_id"][0, 0]) for f in batch] == \
                    [int(f["fragment_id"][0, 0]) for f in received[pid]]
                for a, b in zip(received[pid], batch):
                    assert (a == b).all(), "fragments differ"
                    if overrides is MASKED:  # the env's masks reach the fragments (and the actions keep to them)
                        assert not b["agent", "action_mask"].all()
                version, refs = remote.weights[pid]
                assert version == learner.version
                ray_weights = from_wire(ray_session.get(refs[0]))
                assert (ray_weights == TensorDict.from_module(learner.policy)).all(), f"{pid} weights differ"
            for key, value in local_metrics.items():  # losses, episode statistics, evaluation: all the same
                if not key.startswith("time") and not key.endswith("per_s") and value == value:
                    assert ray_metrics[key] == value, key
        _assert_same_checkpoint(local, remote)
        for pid in local.learners.keys() - trained.keys():  # fixed policies: never trained, on either backend
            assert local.weights[pid][0] == remote.weights[pid][0] == 0
        if not overrides:
            _assert_resumes_exactly(config, local, remote)
        prefix = {id(SPLIT): "other/", id(FIXED): "agents/"}.get(id(overrides), "")  # several: per policy
        assert ray_metrics[f"{prefix}fragments_in_flight"] == 0
        assert ray_metrics[f"{prefix}weights_serializations"] == version + 1  # one put per version
        if not overrides:
            assert _identity(ray_metrics)
            # A learner crash in synchronous mode: it resumes from the checkpoint just taken (the learners
            # were fetched above), the data it lost is re-collected, and the iteration settles exactly.
            (handle,) = [lrn.handle for lrn in remote.trainable.values()]
            handle.crash.remote()  # ordered before the next calls: the next iteration meets a dead learner
            for _ in range(2):
                after = remote.train()
            assert after["learners_restarted"] == 1 and after["policy_version"] == version + 3
            assert after["fragments_in_flight"] == 0 and _identity(after)
            # a worker dead at a checkpoint: the checkpoint is written all the same, without the workers' states
            from orchestration.run_state import trainer_state

            ray_session.kill(remote.fleet.handles()[0])
            assert remote.fleet.state() == [] and trainer_state(remote)[2]["actors"] == []
    finally:
        remote.close()


def _assert_same_checkpoint(local, remote) -> None:
    """The Ray trainer's checkpoint (its learners' states) holds what the local trainer's holds."""
    from orchestration.run_state import trainer_state

    (w_local, t_local, s_local), (w_ray, t_ray, s_ray) = trainer_state(local), trainer_state(remote)
    assert w_local.keys() == w_ray.keys() and all(torch.equal(w_local[k], w_ray[k]) for k in w_local)
    optimizer = [k for k in t_local if k.startswith(("optimizer/", "rng/learner/"))]
    assert optimizer and all(torch.equal(t_local[k], t_ray[k]) for k in optimizer)
    assert {p: v["version"] for p, v in s_local["learners"].items()} == \
        {p: v["version"] for p, v in s_ray["learners"].items()}
    assert s_local["history"] == s_ray["history"] and s_local["env_steps"] == s_ray["env_steps"]


def _assert_resumes_exactly(config: TrainConfig, local, remote) -> None:
    """A new Ray trainer restored from ``remote``'s checkpoint continues as the uninterrupted ``local`` one:
    the same next iteration (its workers' envs, sampling streams and fragment counts restored, not reset)."""
    from orchestration.run_state import restore_trainer_, trainer_state

    assert remote.resume_exact
    resumed = _ray(config)
    try:
        weights, tensors, state = trainer_state(remote)
        (pid, learner), = local.trainable.items()  # the learner's counters are checkpointed as a local one's
        assert state["learners"][pid]["counters"]["fragments_received"] == learner.counters["fragments_received"] > 0
        restore_trainer_(resumed, weights, tensors, state)
        expected, got = local.train(), resumed.train()
        compared = [k for k, v in expected.items() if not k.startswith("time") and not k.endswith("per_s") and v == v]
        assert {k: got[k] for k in compared} == {k: expected[k] for k in compared}  # per-agent means too
        assert got["weights_serializations"] == got["policy_version"] + 2  # one put per version, and the restored
        assert (from_wire(ray.get(resumed.weights[pid][1][0])) == TensorDict.from_module(learner.policy)).all()
    finally:
        resumed.close()


def _server(config: TrainConfig):
    """A learner server in this process (no actor) and one fragment ``[4, 16]`` of the run's env."""
    from core.specs import to_json
    from orchestration.builder import build_trainer
    from orchestration.ray_learner import LearnerServer

    local = build_trainer(config)
    fragment = local.fleet.actors[0].collect()
    (pid, learner), = local.trainable.items()
    server = LearnerServer(pid, config, to_json(local.tree), to_wire(learner.published()[1]))
    return server, pid, fragment


def _meta(pid: str, fid: int, version: int = 0) -> dict:
    return {"fragment_id": fid, "worker_id": 0, "sequence": fid, "policy_versions": {pid: version}}


def test_learner_inbox_is_idempotent_and_drops_stale_data(ray_session):
    server, pid, fragment = _server(_config(train_batch_size=64, mode="async", max_staleness=0))
    ref = ray_session.put(to_wire(fragment))
    server.push(_meta(pid, 0), [ref])
    server.push(_meta(pid, 0), [ref])  # a retried delivery
    assert server.report()["counters"]["duplicates"] == 1 and server.new_steps() == fragment.batch_size.numel()
    assert server.train(take_all=True) is not None and server.learner.version == 1
    server.push(_meta(pid, 1), [ref])  # acted with version 0, the learner is at 1
    report = server.report()
    assert report["totals"] == {"accepted": 1, "stale": 1, "lost": 0} and server.new_steps() == 0
    assert server.trained_counts() == {0: 1}
    # a gap in a worker's sequence: pushes 2 and 3 never arrived (e.g. this learner was down): lost
    server.push(_meta(pid, 4, server.learner.version), [ref])
    assert server.report()["totals"] == {"accepted": 2, "stale": 1, "lost": 2}
    # settling with what the workers produced (all flushed): 5 and 6 never came, worker 9 was never heard
    assert server.settle({0: 7, 9: 3}) == 5
    assert server.report()["totals"] == {"accepted": 2, "stale": 1, "lost": 7} and server.settle({0: 7}) == 0


def test_reuse_limit_bounds_how_often_a_fragment_is_trained(ray_session):
    server, pid, fragment = _server(_config(train_batch_size=128, mode="async", max_staleness=10, reuse_limit=2))
    ref = ray_session.put(to_wire(fragment))  # 64 env steps: a batch is two fragments
    for fid in range(6):
        server.push(_meta(pid, fid, server.learner.version), [ref])
        if server.ready():
            assert fid in server.train()["fragment_ids"]  # new data first, topped up with reused data
    counts = server.trained_counts()
    assert max(counts.values()) == 2 and sum(counts.values()) == 2 * server.learner.version
    assert not server.ready()  # nothing new: the learner does not train on reused data alone


@pytest.fixture(scope="module")
def streaming(ray_session):
    """One asynchronous trainer shared by the staleness and chaos tests (Ray actors start slowly here)."""
    trainer = _ray(_config(train_batch_size=128, mode="async", max_staleness=1))
    yield trainer
    trainer.close()


def test_streaming_workers_faster_than_the_learner_wait_for_credit_instead_of_making_stale_data(ray_session):
    """Before the credit pool, workers filled every queue and most fragments went stale (70% of a CLI run's)."""
    trainer = _ray(_config(train_batch_size=128, mode="async", max_staleness=1))  # a batch: two 64-step fragments
    try:
        waited = 0.0
        for _ in range(12):
            metrics = trainer.train()
            if metrics["pipeline/fragments"]:  # per fragment built in the iteration's window (none: NaN)
                waited += metrics["pipeline/credit_wait_ms"] * metrics["pipeline/fragments"]
    finally:
        trainer.close()
    trained, capacity, workers = metrics["env_steps_trained"] // 64, 4, 2  # capacity: (1 + 1) batches
    assert _identity(metrics) and trained == 24
    # made: what was trained, what the pool lets run ahead, a credit asked ahead per worker, and slack
    assert metrics["fragments_produced"] <= trained + capacity + 2 * workers, metrics
    # stale: 0-1 on an idle machine, 3 once with the 2 cores loaded by other tests; without the pool most were
    assert metrics["fragments_stale"] <= 2 * workers and waited > 0, metrics


def test_with_two_learners_a_fragment_frees_its_credit_when_both_are_done_with_it(ray_session):
    """Had the first learner's training given the credit back, the workers would run ahead of the second one,
    which got their fragments too late: 18 to 24 of them stale in 10 iterations, over both learners, with that
    rule put back (now 0 to 2, and 4 with the 2 cores loaded by the rest of the suite)."""
    trainer = _ray(_config(mode="async", max_staleness=1, **SPLIT))  # a batch: two 64-step fragments
    try:
        for _ in range(10):
            metrics = trainer.train()
    finally:
        trainer.close()
    assert metrics["agents/policy_version"] == metrics["other/policy_version"] == 10, metrics
    assert metrics["agents/fragments_stale"] + metrics["other/fragments_stale"] <= 8, metrics


def test_slow_worker_data_beyond_max_staleness_is_dropped_and_counted(streaming, ray_session):
    ray_session.get(streaming.fleet.handles()[1].set_fragment_delay.remote(0.4))
    built = 0  # fragments the workers' pipeline reports counted (an iteration may train on earlier ones only)
    for _ in range(12):
        metrics = streaming.train()
        built += metrics["pipeline/fragments"]
    assert metrics["trained_max_lag"] <= 1  # nothing older than max_staleness reached the loss
    assert metrics["fragments_stale"] >= 1  # the slow worker's fragments arrived too late
    assert _identity(metrics)
    assert metrics["policy_version"] == 12 and built > 0
    # the workers sample while the learner trains: env_steps counts all of it, env_steps_trained the batches
    assert metrics["env_steps_trained"] == 12 * 128 < metrics["env_steps"]
    ray_session.get(streaming.fleet.handles()[1].set_fragment_delay.remote(0.0))


def test_killed_workers_are_replaced_and_accounting_is_exact(streaming, ray_session):
    fleet = streaming.fleet
    (pid, proxy), = streaming.trainable.items()
    learner = proxy.handle
    # A busy learner: pushes pile up behind it; a worker killed now loses what it had in flight.
    paused = learner.pause.remote(1.5)
    time.sleep(1.0)
    fleet.monitors()  # the workers' last reports: fragments they produced so far
    ray_session.kill(fleet.handles()[0])
    ray_session.get(paused)
    for _ in range(40):  # until the fleet re-created it
        streaming.train()
        if fleet.restarts == 1:
            break
    for handle in fleet.handles():  # then the whole fleet at once
        ray_session.kill(handle)
    for _ in range(40):
        streaming.train()
        if fleet.restarts == 3:
            break
    for _ in range(2):
        metrics = streaming.train()
    assert fleet.restarts == 3 and metrics["workers_restarted"] == 3
    assert fleet.alive() == 2
    # The learner crashes (workers streaming): Ray restarts it and it resumes from its last checkpoint.
    checkpoint = proxy.snapshot()
    before = streaming.accounting()
    delivered = lambda: sum(ray_session.get(learner.report.remote())["totals"].values())  # noqa: E731
    got = delivered()
    fleet.credits.grant.remote(2)  # workers paced to training may wait for credit: these reach the learner
    for _ in range(6000):  # until one reached it after its checkpoint (the crash loses it)
        if delivered() > got:
            break
        time.sleep(0.01)
    learner.crash.remote()  # the process exits; Ray restarts it
    report = streaming.learner_reports()[pid]  # after the crash (calls are ordered): the driver waits it out
    assert report["restarts"] == 1 and report["restored_version"] == checkpoint["version"]
    assert report["version"] > before["policy_version"]  # versions keep rising: workers load its weights
    restored = ray_session.get(learner.state.remote())["weights"]
    assert all(np.array_equal(restored[k], v) for k, v in checkpoint["weights"].items())
    for _ in range(3):
        metrics = streaming.train()  # training goes on
    assert metrics["learners_restarted"] == 1 and metrics["policy_version"] == report["version"] + 3
    assert _identity(metrics)
    trained = ray_session.get(learner.trained_counts.remote())
    assert set(trained.values()) == {1}  # no fragment trained twice
    assert any(fid >> 48 for fid in trained)  # re-created workers (incarnation >= 1) delivered data
    streaming.close()
    final = streaming.accounting()
    assert _identity(final) and final["fragments_in_flight"] == 0
    # lost: what the first killed worker had in flight and what the learner got after its checkpoint
    assert final["fragments_lost"] >= before["fragments_lost"] + 1
    assert final["fragments_duplicate"] == 0 and final["fragments_max_uses"] == 1


def test_config_from_params_applies_dotted_overrides():
    from orchestration.sweeps import config_from_params

    base = _config()
    out = config_from_params(base, {"lr": 1e-3, "ppo.clip_eps": 0.1, "rollout.num_envs": 8})
    assert (out.lr, out.ppo.clip_eps, out.rollout.num_envs) == (1e-3, 0.1, 8)
    assert out.rollout.fragment_length == base.rollout.fragment_length and out.ppo.gamma == base.ppo.gamma
    with pytest.raises(KeyError, match="nope"):
        config_from_params(base, {"ppo.nope": 1})


def test_tune_runs_a_grid_as_parallel_trials(ray_session, tmp_path):
    tune = pytest.importorskip("ray.tune", exc_type=ImportError)  # ray[tune]: pandas, pyarrow, tensorboardX
    from orchestration.ray_tune import run_tune

    base = _config(iterations=2, rollout=RolloutConfig(num_envs=4, fragment_length=16))
    results = run_tune(base, {"lr": tune.grid_search([3e-4, 1e-3])}, cpus_per_trial=0.1, storage_path=str(tmp_path))
    assert len(results) == 2 and not results.errors
    assert sorted(r.config["lr"] for r in results) == [3e-4, 1e-3]
    assert all(r.metrics["iteration"] == 2 and r.metrics["env_steps"] == 128 for r in results)
