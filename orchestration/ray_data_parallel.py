"""A data-parallel learner group on Ray: several processes train one policy on shards of each batch.

Each rank is a Ray actor (GPU each when the cluster has them) holding a :class:`PPOLearner`, joined into a
torch.distributed group whose gradients are averaged (:mod:`orchestration.data_parallel`). The driver puts
every fragment in the object store once (wire form) and hands each rank the refs of its shard; rank 0
publishes the weights (all ranks hold the same ones).

Usage::

    group = DataParallelGroup(policy, groups, world_size=2, ppo=..., lr=..., batch_steps=..., seed=0)
    metrics = group.train(fragments)          # equal shards, one gradient average per minibatch
    version, weights = group.published()
"""

from __future__ import annotations

import socket
from typing import Mapping, Sequence

import ray
import torch
from tensordict import TensorDict

from core.losses import PPOConfig
from core.policies import GroupPolicy
from orchestration.data_parallel import average_gradients_, check_in_sync, init_process_group
from orchestration.learner import PPOLearner, resolve_device
from orchestration.wire import from_wire, to_wire


class DataParallelRank:
    """One rank: a PPOLearner whose gradients are averaged over the group."""

    def __init__(self, policy: GroupPolicy, groups: Mapping[str, torch.Tensor | None], *, ppo: PPOConfig, lr: float,
                 batch_steps: int, seed: int, device: str = "auto") -> None:
        torch.set_num_threads(1)
        self.learner = PPOLearner(policy, groups, ppo=ppo, lr=lr, batch_steps=batch_steps, seed=seed,
                                  device=resolve_device(device))

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (rank 0 hosts the rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, rank: int, world_size: int, address: str, port: int) -> None:
        init_process_group(rank, world_size, address, port, self.learner.device)
        average_gradients_(self.learner.policy)

    def train(self, messages: Sequence[ray.ObjectRef], progress: float = 0.0,
              lr: float | None = None) -> dict[str, float]:
        """Trains on this rank's shard (wire-form fragments); returns the rank's metrics."""
        if lr is not None:
            self.learner.set_lr(lr)
        for msg in ray.get(list(messages)):
            self.learner.receive(from_wire(msg, copy=True))
        return self.learner.train(progress)

    def in_sync(self) -> bool:
        return check_in_sync(self.learner.policy)

    def published(self) -> tuple[int, dict]:
        version, weights = self.learner.published()
        return version, to_wire(weights)


RemoteRank = ray.remote(DataParallelRank)


class DataParallelGroup:
    """``world_size`` ranks training one policy together (see the module docstring)."""

    def __init__(self, policy: GroupPolicy, groups: Mapping[str, torch.Tensor | None], *, world_size: int,
                 ppo: PPOConfig, lr: float, batch_steps: int, seed: int = 0, num_cpus: float = 1.0,
                 device: str = "auto") -> None:
        num_gpus = 1 if device != "cpu" and ray.cluster_resources().get("GPU", 0) >= world_size else 0
        shard_steps = batch_steps // world_size
        self.ranks = [RemoteRank.options(num_cpus=num_cpus, num_gpus=num_gpus).remote(
            policy, groups, ppo=ppo, lr=lr, batch_steps=shard_steps, seed=seed,
            device="cuda" if num_gpus else "cpu") for _ in range(world_size)]
        address, port = ray.get(self.ranks[0].address.remote())
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
        results = ray.get([rank.train.remote([refs[i] for i in shard], progress)
                           for rank, shard in zip(self.ranks, shards)])
        return results[0]

    def in_sync(self) -> bool:
        """Whether every rank holds identical parameters."""
        return all(ray.get([r.in_sync.remote() for r in self.ranks]))

    def published(self) -> tuple[int, TensorDict]:
        """Rank 0's ``(version, weights)``."""
        version, msg = ray.get(self.ranks[0].published.remote())
        return version, from_wire(msg, copy=True)

    def shutdown(self) -> None:
        """Ends the rank actors (and their process group)."""
        for r in self.ranks:
            ray.kill(r)


__all__ = ["DataParallelGroup", "DataParallelRank"]
