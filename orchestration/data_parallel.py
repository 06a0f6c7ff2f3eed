"""One policy trained data-parallel by several processes: gradients averaged by DistributedDataParallel.

Each process holds a full copy of the policy and its optimizer and trains on its own shard of the batch with
the unchanged :func:`core.losses.ppo_update_`. The learner's training forward runs through torch's
``DistributedDataParallel`` (:func:`data_parallel_`; :class:`Evaluation` makes the evaluate function its
forward), whose reducer all-reduces the gradients in buckets while backward is still running, so every
process clips, checks and steps with the *averaged* gradient and the copies stay identical (a non-finite
gradient on one rank makes the average non-finite everywhere, so all ranks skip the same step). Ranks must
run the same number of minibatches: give them equal shards. Every trained parameter must take part in each
minibatch's loss (DDP's reducer waits for all of them and raises at the next step otherwise).

DDP replaced one synchronous all-reduce per parameter in a post-accumulate-grad hook:
``benchmarks/data_parallel.py`` (2 ranks, gloo, one thread each, modes interleaved in one run) measured DDP
faster at every size that matters: by far on 64x64 and 256x256 MLPs (one call per bucket instead of one per
parameter), by less on the Nature and IMPALA CNNs on 84x84x3 (never slower); a 1 MB bucket cap did no better
than the default. Observation-normalisation statistics are buffers and are not averaged: DDP copies rank 0's
once when it is built; after that each rank keeps its own, as before.

No Ray here: the processes may be Ray actors (:mod:`orchestration.ray_learner`), ``torch.multiprocessing``
workers or ``torchrun`` ranks. CPU uses the gloo backend, CUDA nccl.
"""

from __future__ import annotations

import inspect
import socket
from collections.abc import Callable
from typing import Any, Mapping

import torch
import torch.distributed as dist

from orchestration.allocator import keep_freed_memory
from orchestration.devices import resolve_device
from orchestration.learner import PPOLearner
from orchestration.wire import from_wire, to_wire


def init_process_group(rank: int, world_size: int, address: str, port: int, device: torch.device) -> None:
    """Joins the group ``tcp://address:port`` as ``rank`` (gloo on CPU, nccl on CUDA)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)


_DDP = torch.nn.parallel.DistributedDataParallel
#: DDP keyword leaving buffers (observation statistics) to each rank after the sync at construction; torch
#: 2.13 renamed ``broadcast_buffers`` and warns on the old name.
NO_FORWARD_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                          inspect.signature(_DDP.__init__).parameters else {"broadcast_buffers": False})


class Evaluation(torch.nn.Module):
    """``policy`` as a module whose forward is ``evaluate(minibatch)``, for ``DistributedDataParallel``.

    DDP prepares its gradient reducer in its own forward, but the learner's training pass is an evaluate
    function (``policy.evaluate_terms`` or ``evaluate_sequence``), not ``policy.forward``: this module runs
    it as the forward, so ``ddp(evaluate, minibatch)`` is ``evaluate(minibatch)`` with averaged gradients.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, evaluate: Callable[[Any], Mapping[str, torch.Tensor]], minibatch: Any) -> dict:
        return dict(evaluate(minibatch))  # a plain dict: DDP finds its tensors


def data_parallel_(learner: PPOLearner) -> torch.nn.parallel.DistributedDataParallel:
    """Makes ``learner``'s training forward run through DDP over its policy (mutates the learner); returns it.

    Every ``backward`` of an update then leaves each ``param.grad`` equal to the mean over ranks. DDP
    broadcasts rank 0's parameters once here, so the copies start identical. Observation normalisers merge
    the moments of the whole batch (summed over ranks), so their statistics stay identical too.
    """
    ddp = _DDP(Evaluation(learner.policy), **NO_FORWARD_BUFFER_SYNC)  # minibatches are on the policy's device
    learner.evaluate_through = ddp
    learner.reduce_statistics = sum_over_ranks  # observation normalisers follow the whole batch on every rank
    return ddp


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the ranks of the default process group (a new tensor; every rank must call)."""
    out = tensor.clone()
    dist.all_reduce(out)
    return out


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
        keep_freed_memory()
        self.learner = PPOLearner(policy, groups, ppo=ppo, lr=lr, batch_steps=batch_steps, seed=seed,
                                  device=resolve_device(device))

    def rendezvous(self) -> tuple[str, int]:
        """This host's address and a free port (for a group whose rank 0 is this one)."""
        return socket.gethostbyname(socket.gethostname()), free_port()

    def join(self, rank: int, world_size: int, address: str, port: int) -> None:
        init_process_group(rank, world_size, address, port, self.learner.device)
        data_parallel_(self.learner)

    def train(self, *messages: Mapping[str, Any], progress: float = 0.0, lr: float | None = None) -> dict[str, float]:
        """One averaged update on this rank's shard (:func:`orchestration.wire.to_wire` messages)."""
        if lr is not None:
            self.learner.set_lr(lr)
        return self.learner.update_([from_wire(m) for m in messages], progress)

    def in_sync(self) -> bool:
        return check_in_sync(self.learner.policy)

    def load_state_(self, state: Mapping[str, Any]) -> None:
        """Loads rank 0's :meth:`PPOLearner.state` (a resumed group: each step averages the gradients and the
        normalisers' moments and every rank draws the same minibatches, so every rank's state is rank 0's)."""
        self.learner.load_state_(state)

    def published(self) -> tuple[int, dict]:
        version, weights = self.learner.published()
        return version, to_wire(weights)


__all__ = ["DataParallelRank", "Evaluation", "check_in_sync", "data_parallel_", "free_port", "init_process_group",
           "shard_by_rows", "sum_over_ranks"]
