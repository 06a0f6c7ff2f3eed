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

import torch
import torch.distributed as dist


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


__all__ = ["average_gradients_", "check_in_sync", "init_process_group"]
