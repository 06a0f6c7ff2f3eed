"""One policy trained data-parallel by several processes: gradients averaged with torch.distributed.

Each process holds a full copy of the policy and its optimizer and trains on its own shard of the batch with
the unchanged :func:`core.losses.ppo_update_`. A hook on every parameter all-reduces its gradient as soon
as backward has accumulated it, so every process clips, checks and steps with the *averaged* gradient and
the copies stay identical (a non-finite gradient on one rank makes the average non-finite everywhere, so all
ranks skip the same step). Ranks must run the same number of minibatches: give them equal shards.

No Ray here: the processes may be Ray actors (:mod:`orchestration.ray_learner`), ``torch.multiprocessing``
workers or ``torchrun`` ranks. CPU uses the gloo backend, CUDA nccl.
"""

from __future__ import annotations

import socket
from typing import Any, Mapping

import torch
import torch.distributed as dist

from orchestration.learner import PPOLearner, resolve_device
from orchestration.wire import from_wire, to_wire


def init_process_group(rank: int, world_size: int, address: str, port: int, device: torch.device) -> None:
    """Joins the group ``tcp://address:port`` as ``rank`` (gloo on CPU, nccl on CUDA)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)


def average_gradients_(module: torch.nn.Module) -> list:
    """Registers the all-reduce hooks on ``module``'s parameters (mutates it); returns the hook handles.

    Every ``backward`` then leaves each ``param.grad`` equal to the mean over ranks.
    """
    world = dist.get_world_size()

    def hook(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(world)

    return [p.register_post_accumulate_grad_hook(hook) for p in module.parameters() if p.requires_grad]


def check_in_sync(module: torch.nn.Module) -> bool:
    """True when every rank holds the same parameters (an all-reduced max of the absolute difference)."""
    flat = torch.cat([p.detach().flatten() for p in module.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = (flat - ref).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return bool(diff == 0)


def shard_by_rows(fragments: list, world: int, policy_id: str) -> list:
    """The fragments ``[N, T]`` concatenated and split by env rows into ``world`` equal shards (rank 0's first).

    Raises:
        ValueError: naming the policy when ``N`` is not a multiple of ``world``.
    """
    from core.buffers import concat_fragments

    batch = concat_fragments(fragments)
    rows = batch.batch_size[0]
    if rows % world:
        raise ValueError(f"policy {policy_id!r}: {rows} env rows cannot be split evenly over {world} "
                         f"data-parallel learners (RayConfig.learners_per_policy)")
    return list(batch.split(rows // world, dim=0))


def free_port() -> int:
    """A TCP port free on this host now (where a rank 0 hosts the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class DataParallelRank:
    """A peer rank of a data-parallel learner: a PPOLearner whose gradients are averaged over the group.

    Usage (each rank a process; :mod:`orchestration.ray_learner` makes them Ray actors)::

        rank.join(rank_index, world_size, address, port)
        metrics = rank.train(shard_message, progress=0.3)     # wire-form fragments of this rank's shard
    """

    def __init__(self, policy, groups, *, ppo, lr: float, batch_steps: int, seed: int, device: str = "auto") -> None:
        torch.set_num_threads(1)
        self.learner = PPOLearner(policy, groups, ppo=ppo, lr=lr, batch_steps=batch_steps, seed=seed,
                                  device=resolve_device(device))

    def rendezvous(self) -> tuple[str, int]:
        """This host's address and a free port (for a group whose rank 0 is this one)."""
        return socket.gethostbyname(socket.gethostname()), free_port()

    def join(self, rank: int, world_size: int, address: str, port: int) -> None:
        init_process_group(rank, world_size, address, port, self.learner.device)
        average_gradients_(self.learner.policy)

    def train(self, *messages: Mapping[str, Any], progress: float = 0.0, lr: float | None = None) -> dict[str, float]:
        """One averaged update on this rank's shard (:func:`orchestration.wire.to_wire` messages)."""
        if lr is not None:
            self.learner.set_lr(lr)
        return self.learner.update_([from_wire(m) for m in messages], progress)

    def in_sync(self) -> bool:
        return check_in_sync(self.learner.policy)

    def published(self) -> tuple[int, dict]:
        version, weights = self.learner.published()
        return version, to_wire(weights)


__all__ = ["DataParallelRank", "average_gradients_", "check_in_sync", "free_port", "init_process_group"]
