"""One policy trained data-parallel by two Ray actors (torch.distributed, gloo on CPU)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import ray
import torch
from tensordict import TensorDict

from core.losses import PPOConfig
from orchestration.assignment import assign, groups_of
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.learner import PPOLearner
from orchestration.ray_learner import RemoteRank
from orchestration.ray_session import kill_actor
from orchestration.wire import from_wire, to_wire
from orchestration.builder import build_trainer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


class DataParallelGroup:
    """``world_size`` data-parallel ranks (Ray actors) training one policy together, driven from the test."""

    def __init__(self, policy, groups, *, world_size: int, ppo, lr: float, batch_steps: int, seed: int = 0,
                 num_cpus: float = 1.0, device: str = "auto") -> None:
        num_gpus = 1 if device != "cpu" and ray.cluster_resources().get("GPU", 0) >= world_size else 0
        self.ranks = [RemoteRank.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(
            policy, groups, ppo=ppo, lr=lr, batch_steps=batch_steps // world_size, seed=seed,
            device="cuda" if num_gpus else "cpu") for _ in range(world_size)]
        address, port = ray.get(self.ranks[0].rendezvous.remote())
        ray.get([r.join.remote(i, world_size, address, port) for i, r in enumerate(self.ranks)])

    def train(self, fragments: Sequence[TensorDict], progress: float = 0.0,
              shards: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
        """One synchronous update: fragment ``i`` goes to rank ``i % world_size`` (or as ``shards`` say)."""
        world = len(self.ranks)
        if shards is None:
            if len(fragments) % world:
                raise ValueError(f"{len(fragments)} fragments cannot be split evenly over {world} ranks")
            shards = [list(range(r, len(fragments), world)) for r in range(world)]
        refs = [ray.put(to_wire(f)) for f in fragments]  # one object-store copy per fragment
        return ray.get([rank.train.remote(*[refs[i] for i in shard], progress=progress)
                        for rank, shard in zip(self.ranks, shards)])[0]

    def in_sync(self) -> bool:
        return all(ray.get([r.in_sync.remote() for r in self.ranks]))

    def published(self) -> tuple[int, TensorDict]:
        version, msg = ray.get(self.ranks[0].published.remote())
        return version, from_wire(msg, copy=True)

    def shutdown(self) -> None:
        for r in self.ranks:
            kill_actor(r)


def _setup():
    config = TrainConfig(env="builtin:cartpole", seed=0, rollout=RolloutConfig(num_envs=8, fragment_length=16),
                         ppo=PPOConfig(minibatch_size=32, num_epochs=2))
    trainer = build_trainer(config)
    fragments = [trainer.fleet.actors[0].collect() for _ in range(4)]
    learner = trainer.learners["agent"]
    policy = copy.deepcopy(learner.policy)
    return config, trainer, fragments, policy, groups_of(assign(trainer.tree), "agent")


def test_two_ranks_on_the_same_shard_equal_one_learner(ray_session):
    config, _, fragments, policy, groups = _setup()
    reference = PPOLearner(copy.deepcopy(policy), groups, ppo=config.ppo, lr=config.lr, batch_steps=256, seed=5)
    for f in fragments[:2]:
        reference.receive(f)
    reference.train()
    group = DataParallelGroup(policy, groups, world_size=2, ppo=config.ppo, lr=config.lr, batch_steps=512, seed=5,
                              num_cpus=0.5, device="cpu")
    try:
        # Both ranks get the same two fragments: the averaged gradient is each rank's own, so the result must
        # equal a single learner's on that data.
        group.train(fragments[:2] * 2, shards=[[0, 1], [2, 3]])
        version, weights = group.published()
        assert version == 1 and group.in_sync()
        theirs = TensorDict.from_module(reference.policy)
        for key, value in weights.items(include_nested=True, leaves_only=True):
            torch.testing.assert_close(value, theirs.get(key), rtol=1e-5, atol=1e-6)
        # Different shards: the ranks still end with identical parameters (one averaged step each minibatch).
        group.train(fragments)
        assert group.in_sync() and group.published()[0] == 2
    finally:
        group.shutdown()


def test_ray_backend_trains_each_policy_with_two_data_parallel_learners(ray_session):
    from orchestration.config import RayConfig

    config = TrainConfig(env="builtin:cartpole", seed=0, iterations=3, backend="ray",
                         rollout=RolloutConfig(num_envs=4, fragment_length=16, num_workers=2),
                         ppo=PPOConfig(minibatch_size=32, num_epochs=2),
                         ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0, learners_per_policy=2))
    trainer = build_trainer(config)
    try:
        before = trainer.learners["agent"].weights()[1].clone()
        for _ in range(3):
            metrics = trainer.train()
        assert metrics["policy_version"] == 3 and metrics["fragments_lost"] == 0
        assert metrics["env_steps_trained"] == metrics["env_steps"]  # both ranks' shards, every batch once
        after = trainer.learners["agent"].weights()[1]
        assert not (after == before).all()
        server = trainer.learners["agent"].handle
        peers = ray_session.get(server.peer_handles.remote())
        assert len(peers) == 1
        assert all(ray_session.get([server.in_sync.remote()] + [p.in_sync.remote() for p in peers]))
    finally:
        trainer.close()


def test_a_resumed_data_parallel_group_goes_on_as_an_uninterrupted_one(ray_session):
    """Rank 0's checkpointed state reaches its peers on resume: they went on from their fresh weights and Adam
    state, so the group's next step averaged gradients taken at different weights (and the copies drifted). With
    reward scaling, each peer's own return accumulators (its rows) are checkpointed and restored too."""
    from core.policies import PolicyConfig
    from orchestration.config import RayConfig
    from orchestration.run_state import restore_trainer_, trainer_state

    config = TrainConfig(env="builtin:cartpole", seed=0, iterations=3, backend="ray", anneal_lr=False, lr=0.01,
                         policy=PolicyConfig(scale_rewards=True, normalize_observations=True),
                         rollout=RolloutConfig(num_envs=4, fragment_length=16, num_workers=2),
                         ppo=PPOConfig(minibatch_size=32, num_epochs=2),
                         ray=RayConfig(worker_num_cpus=0, learner_num_cpus=0, learners_per_policy=2))
    whole = build_trainer(config)
    try:
        for _ in range(2):
            whole.train()
        saved = trainer_state(whole)
        expected = whole.train()
    finally:
        whole.close()
    resumed = build_trainer(config)
    try:
        restore_trainer_(resumed, *saved)
        got = resumed.train()
        server = resumed.learners["agent"].handle
        peers = ray_session.get(server.peer_handles.remote())
        assert all(ray_session.get([server.in_sync.remote()] + [p.in_sync.remote() for p in peers]))
    finally:
        resumed.close()
    for key in ("loss_policy", "loss_value", "grad_norm", "approx_kl", "policy_version", "reward_scale"):
        assert got[key] == expected[key], key
