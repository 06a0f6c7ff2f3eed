"""Data-parallel gradient averaging: per-parameter all-reduce hooks against DistributedDataParallel.

Two processes (``torch.multiprocessing``, gloo, CPU, one torch thread each) run the same PPO-like step on the
same shapes: forward of an actor-critic on a minibatch, clipped surrogate + value MSE - entropy, backward,
then the global gradient norm read on the host (the one sync of :func:`core.losses.ppo_update_`). Modes:

- ``hooks``: a post-accumulate-grad hook on every parameter does one synchronous all-reduce (sum, then divide
  by the world size) as soon as backward has accumulated that gradient (Shoal's learner before DDP);
- ``ddp``: ``DistributedDataParallel`` over :class:`orchestration.data_parallel.Evaluation` (what the learner
  uses now): gradients all-reduced in buckets (default 25 MB cap), asynchronously, overlapped with backward;
- ``ddp_1mb``: the same with ``bucket_cap_mb=1`` (more, smaller buckets: more overlap, more calls);
- ``local``: no communication (the limit).

Network sizes: separate actor and critic MLPs 64x64 and 256x256 (tanh, 64-dim observations, minibatch 256 per
rank), and the image encoders of :class:`core.policies.networks.ImageEncoder` on 84x84x3 uint8 images (Nature
CNN, IMPALA CNN; minibatch 32 per rank, 16 for IMPALA) with linear policy and value heads. Modes are interleaved within
every repeat (rotating order); each (size, mode) reports the median and the minimum over repeats of rank 0's
mean step time, the ratio of medians to ``local``, and ``hooks_over``: per repeat, hooks' time over the mode's
(blocks run back to back), median over repeats (> 1: the mode is faster than the hooks). Compare ratios within
one run: the machine may be shared. Prints one JSON.

    python benchmarks/data_parallel.py            # full run (< 2 minutes on 2 cores)
    python benchmarks/data_parallel.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.policies.networks import ImageEncoder  # noqa: E402
from core.specs import Leaf  # noqa: E402
from orchestration.data_parallel import NO_FORWARD_BUFFER_SYNC, Evaluation, free_port  # noqa: E402

MODES = ("hooks", "ddp", "ddp_1mb", "local")
NUM_ACTIONS, OBS_DIM = 6, 64
#: name -> (minibatch per rank, steps per timed block)
SIZES = {"mlp64": (256, 10), "mlp256": (256, 5), "nature_cnn_84": (32, 2), "impala_cnn_84": (16, 1)}


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs, or a shared image encoder with linear heads."""

    def __init__(self, size: str) -> None:
        super().__init__()
        if size.startswith("mlp"):
            h = int(size[3:])
            self.encoder = None
            self.actor = nn.Sequential(nn.Linear(OBS_DIM, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(),
                                       nn.Linear(h, NUM_ACTIONS))
            self.critic = nn.Sequential(nn.Linear(OBS_DIM, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(),
                                        nn.Linear(h, 1))
        else:
            leaf = Leaf.box((84, 84, 3), 0, 255, dtype=torch.uint8)
            self.encoder = ImageEncoder(leaf, "hwc", arch=size.split("_")[0])
            self.actor = nn.Linear(self.encoder.out_features, NUM_ACTIONS)
            self.critic = nn.Linear(self.encoder.out_features, 1)

    def evaluate(self, mb: dict) -> dict:
        x = mb["obs"] if self.encoder is None else self.encoder(mb["obs"])
        log_p = self.actor(x).log_softmax(-1)
        return {"log_prob": log_p.gather(-1, mb["action"]), "entropy": -(log_p.exp() * log_p).sum(-1, keepdim=True),
                "value": self.critic(x)}


def ppo_loss(out: dict, mb: dict) -> torch.Tensor:
    ratio = (out["log_prob"] - mb["old_log_prob"]).exp()
    adv = mb["advantage"]
    surrogate = torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    return -surrogate + 0.5 * (out["value"] - mb["target"]).pow(2).mean() - 0.01 * out["entropy"].mean()


def minibatch(size: str, n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    obs = (torch.randn(n, OBS_DIM, generator=g) if size.startswith("mlp")
           else torch.randint(0, 256, (n, 84, 84, 3), generator=g, dtype=torch.uint8))
    return {"obs": obs, "action": torch.randint(0, NUM_ACTIONS, (n, 1), generator=g),
            "old_log_prob": torch.randn(n, 1, generator=g) - 2.0, "advantage": torch.randn(n, 1, generator=g),
            "target": torch.randn(n, 1, generator=g)}


def hooks_(module: nn.Module) -> None:
    """The per-parameter synchronous all-reduce (sum, then divide)."""
    world = dist.get_world_size()

    def hook(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(world)

    for p in module.parameters():
        p.register_post_accumulate_grad_hook(hook)


def step(net: ActorCritic, forward, mb: dict) -> float:
    for p in net.parameters():
        p.grad = None
    ppo_loss(forward(mb), mb).backward()
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in net.parameters()]))).item()


def worker(rank: int, world: int, port: int, repeats: int, quick: bool, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for size, (n, steps) in SIZES.items():
        steps = 1 if quick else steps
        forwards, nets = {}, {}
        for mode in MODES:
            torch.manual_seed(0)
            net = nets[mode] = ActorCritic(size)
            if mode == "hooks":
                hooks_(net)
            if mode.startswith("ddp"):
                ddp = nn.parallel.DistributedDataParallel(
                    Evaluation(net), bucket_cap_mb=1 if mode == "ddp_1mb" else None, **NO_FORWARD_BUFFER_SYNC)
                forwards[mode] = lambda mb, ddp=ddp, net=net: ddp(net.evaluate, mb)
            else:
                forwards[mode] = net.evaluate
        mb = minibatch(size, n, seed=rank)
        norms = {m: step(nets[m], forwards[m], mb) for m in MODES}  # warm-up (and DDP's first iteration)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for r in range(repeats):
            for mode in MODES[r % len(MODES):] + MODES[: r % len(MODES)]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    step(nets[mode], forwards[mode], mb)
                times[mode].append((time.perf_counter() - start) / steps)
        med = {m: statistics.median(t) for m, t in times.items()}
        paired = {m: statistics.median(h / x for h, x in zip(times["hooks"], times[m])) for m in MODES[1:]}
        results[size] = {
            "params": sum(p.numel() for p in nets["local"].parameters()), "minibatch_per_rank": n,
            "step_ms_median": {m: round(1e3 * v, 2) for m, v in med.items()},
            "step_ms_min": {m: round(1e3 * min(t), 2) for m, t in times.items()},
            "ratio_to_local": {m: round(med[m] / med["local"], 3) for m in MODES if m != "local"},
            # per repeat hooks' time over the mode's (adjacent blocks), median over repeats: > 1, hooks slower
            "hooks_over": {m: round(v, 3) for m, v in paired.items()},
            "averaged_norms_agree": abs(norms["hooks"] - norms["ddp"]) <= 1e-4 * norms["hooks"],
        }
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, one step per block")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    start = time.perf_counter()
    mp.start_processes(worker, args=(2, free_port(), repeats, args.quick, queue), nprocs=2, start_method="spawn")
    sizes = queue.get()
    print(json.dumps({"benchmark": "data_parallel", "world_size": 2, "backend": "gloo", "threads_per_rank": 1,
                      "repeats": repeats, "torch": torch.__version__, "sizes": sizes,
                      "wall_s": round(time.perf_counter() - start, 1)}, indent=1))


if __name__ == "__main__":
    main()
