"""The one loop on the Ray backend: the league swaps opponents in every rollout worker, learners on one node
share a fragment's memory, async mode runs the same inbox rules as the local backend."""

from __future__ import annotations

import re
import sys

import pytest

from core.losses import PPOConfig
from orchestration.builder import build_trainer
from orchestration.config import RayConfig, RolloutConfig, TrainConfig
from orchestration.league import LeagueTrainer
from orchestration.wire import to_wire

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = RayConfig(worker_num_cpus=0, learner_num_cpus=0)


def test_league_on_ray_swaps_the_opponent_in_every_worker_and_counts_games_against_it(ray_session):
    config = TrainConfig(env="pettingzoo:classic.connect_four_v3", seed=0, iterations=4, lr=1e-3, backend="ray",
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",), ray=RAY,
                         rollout=RolloutConfig(num_envs=4, fragment_length=32, num_workers=2),
                         ppo=PPOConfig(minibatch_size=128))
    league = LeagueTrainer(build_trainer(config), learner="player", opponent="opponent", snapshot_every=1, seed=1)
    try:
        games = 0
        for _ in range(4):
            metrics = league.train()
            workers = league.trainer.fleet.actor_weights("opponent")
            assert len(workers) == 2
            assert all((w == league.current.weights).all() for w in workers)  # the drawn member, everywhere
            games += metrics["league_games"]
            assert metrics["league_games"] == metrics["episodes"]  # every game of the iteration was against it
        assert len(league.pool) == 5 and sum(m.games for m in league.pool) == games > 0
        drawn = {league.pool.index(m) for m in league.pool if m.games}
        assert drawn - {0}, "a past snapshot was drawn and played"
        learner_now = league.trainer.learners["player"].weights()[1]
        assert not (learner_now == league.pool[1].weights).all()  # snapshots are copies, not views
    finally:
        league.trainer.close()


def _backing(addresses: list[int], maps: str) -> list[tuple[str, int]]:
    """(mapped file, offset in it) of each address, from a /proc/<pid>/maps text."""
    out = []
    for address in addresses:
        for line in maps.splitlines():
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                out.append((parts[5] if len(parts) > 5 else "", int(parts[2], 16) + address - lo))
                break
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/<pid>/maps")
def test_two_learners_on_one_node_read_one_object_store_copy_of_a_shared_fragment(ray_session):
    from core.specs import to_json
    from orchestration.ray_learner import RemoteLearner

    config = TrainConfig(env="builtin:spread", mode="async", max_staleness=10, ray=RAY,
                         policy_mapping=(("agents_1", "other"),), rollout=RolloutConfig(num_envs=4, fragment_length=16))
    local = build_trainer(config)
    fragment = local.fleet.actors[0].collect()
    meta = local.fleet.actors[0].fragment_meta(fragment)
    servers = [RemoteLearner.options(num_cpus=0).remote(pid, config, to_json(local.tree),
                                                       to_wire(local.learners[pid].published()[1]))
               for pid in ("agents", "other")]
    ref = ray_session.put(to_wire(fragment))
    ray_session.get([s.push.remote(meta, [ref]) for s in servers])
    seen = ray_session.get([s.pooled_memory.remote() for s in servers])
    backing = [_backing(s["addresses"], s["maps"]) for s in seen]
    assert all(len(b) == 1 for b in backing)
    (file_a, offset_a), (file_b, offset_b) = backing[0][0], backing[1][0]
    assert re.search(r"plasma|/dev/shm|memfd", file_a), file_a  # the object store's shared memory, not a copy
    assert (file_a, offset_a) == (file_b, offset_b)  # one copy, mapped by both learner processes
    for server in servers:
        ray_session.kill(server)
    local.close()


def _refs_in(value) -> list:
    """The object refs and actor handles anywhere inside ``value`` (dicts, lists, tuples)."""
    import ray
    from ray.actor import ActorHandle

    if isinstance(value, (ray.ObjectRef, ActorHandle)):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs_in(v)]
    return []


def test_restartable_learners_take_no_object_ref_and_start_from_the_registered_weights(ray_session, monkeypatch):
    """Ray keeps a restartable actor's constructor argument that is, or holds, an object ref (an actor handle
    holds one) only while its owner does, and logs an error for each such actor (ray-project/ray#53727). The
    learner takes plain values, looks the checkpoint registry up by name and reads its initial weights
    there: the ones the workers start from."""
    import ray

    import orchestration.ray_learner as ray_learner
    from orchestration.wire import from_wire

    seen, real = [], ray_learner.RemoteLearner

    class Recording:  # RemoteLearner.options(...).remote(...), recording the constructor's arguments
        def options(self, **options):
            chosen = real.options(**options)

            class Creator:
                def remote(self, *args, **kwargs):
                    seen.append((options, args, kwargs))
                    return chosen.remote(*args, **kwargs)
            return Creator()

    monkeypatch.setattr(ray_learner, "RemoteLearner", Recording())
    config = TrainConfig(env="builtin:cartpole", seed=0, iterations=1, backend="ray", ray=RAY, train_batch_size=16,
                         rollout=RolloutConfig(num_envs=2, fragment_length=8, num_workers=1))
    trainer = build_trainer(config)
    try:
        (options, args, kwargs), = seen
        assert options["max_restarts"] > 0 and not _refs_in([list(args), kwargs])
        learner = trainer.learners["agent"]
        version, refs = ray.get(learner.handle.published.remote())  # what the actor itself holds
        (worker,) = trainer.fleet.actor_weights("agent")
        assert version == 0 and (from_wire(ray.get(refs[0])) == worker).all()
        assert trainer.train()["policy_version"] == 1
    finally:
        trainer.close()


class _FailingLearner:
    def __init__(self, *args, **kwargs) -> None:
        raise ValueError("this learner cannot start")

    def published(self):
        return None


def test_a_learner_that_fails_to_start_raises_its_error_and_leaves_no_actor_behind(ray_session, monkeypatch):
    """The workers start while the learners do: when a learner's constructor fails, the build raises that
    error and kills what it started (the workers' CPUs are free again on the shared Ray instance)."""
    import time

    import ray

    import orchestration.ray_learner as ray_learner

    monkeypatch.setattr(ray_learner, "RemoteLearner", ray.remote(_FailingLearner))
    free = ray.available_resources().get("CPU", 0.0)
    config = TrainConfig(env="builtin:cartpole", iterations=1, backend="ray", train_batch_size=16,
                         ray=RayConfig(worker_num_cpus=0.5, learner_num_cpus=0.5),
                         rollout=RolloutConfig(num_envs=2, fragment_length=8, num_workers=2))
    with pytest.raises(ray.exceptions.RayActorError, match="this learner cannot start"):
        build_trainer(config)
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) >= free


def _cpus_back(ray, free: float) -> bool:
    import time

    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) < free and time.monotonic() < deadline:
        time.sleep(0.2)
    return ray.available_resources().get("CPU", 0.0) >= free


def _registries(ray) -> set[str]:
    return {n for n in ray.util.list_named_actors() if n.startswith("shoal-learner-checkpoints")}


def _registries_back(ray, before: set[str]) -> bool:
    import time

    deadline = time.monotonic() + 30
    while not _registries(ray) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    return _registries(ray) <= before


class _FailingRank:
    def __init__(self, *args, **kwargs) -> None:
        raise ValueError(f"this rank cannot start (device {kwargs['device']!r})")

    def join(self, *args) -> None:
        pass


def test_a_data_parallel_rank_that_fails_to_start_leaves_no_actor_behind(ray_session, monkeypatch):
    """With two learners per policy the build waits for every rank at the rendezvous: when a rank fails, the
    error is raised and the learner actor already started, its peers and the checkpoint registry go too."""
    import ray

    import orchestration.ray_learner as ray_learner

    monkeypatch.setattr(ray_learner, "RemoteRank", ray.remote(_FailingRank))
    free, registries = ray.available_resources().get("CPU", 0.0), _registries(ray)
    config = TrainConfig(env="builtin:cartpole", iterations=1, backend="ray", train_batch_size=16,
                         ray=RayConfig(worker_num_cpus=0.5, learner_num_cpus=0.5, learners_per_policy=2),
                         rollout=RolloutConfig(num_envs=2, fragment_length=8, num_workers=1))
    # the peers get the run's --device, resolved in their process as rank 0's is (they had "cuda" on any GPU)
    with pytest.raises(ray.exceptions.RayActorError, match="this rank cannot start \\(device 'auto'\\)") as raised:
        build_trainer(config)
    # checked while the error (whose traceback holds the build's handles) is alive, as a caller that keeps it
    assert _cpus_back(ray, free), "the rank-0 learner actor still holds its CPUs"
    assert _registries_back(ray, registries) and raised.value


def test_an_external_run_that_fails_after_its_ray_learners_started_releases_them(ray_session, monkeypatch, tmp_path):
    """``--env external`` on Ray: when the build fails after the learner actors started (here the inference
    service cannot start), they, the checkpoint registry and the server are released, and the error is raised."""
    import json

    import ray

    import orchestration.external_fleet as external_fleet
    from orchestration.config import ExternalConfig

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"))
    from external_sim import TREE

    class NoService:
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("no inference service here")

    monkeypatch.setattr(external_fleet, "InferenceService", NoService)
    (tmp_path / "tree.json").write_text(json.dumps(TREE))
    free, registries = ray.available_resources().get("CPU", 0.0), _registries(ray)
    config = TrainConfig(env="external", iterations=1, backend="ray", train_batch_size=16,
                         ray=RayConfig(learner_num_cpus=0.5), rollout=RolloutConfig(num_envs=1, fragment_length=8),
                         external=ExternalConfig(tree=str(tmp_path / "tree.json")))
    with pytest.raises(RuntimeError, match="no inference service here") as raised:
        build_trainer(config)
    assert _cpus_back(ray, free), "the learner actor still holds its CPU"  # while the error is alive (above)
    assert _registries_back(ray, registries) and raised.value
