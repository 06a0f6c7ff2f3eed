"""µs per env step to assemble fragments: FragmentBuilder vs a TensorDict per step written into storage.

``builder_preallocated``: FragmentBuilder told the fragment length, so large step leaves (at least
``core.buffers.time_slots.PREALLOCATE_BYTES`` per step: from about 128 envs on) are copied into preallocated storage
as they come instead of listed and stacked (half the memory at the boundary, issue 18); below that size it is
the plain builder.

Layout (notes/tensordict-hot-paths.md, "3-agent step"): group ``agents`` ``[env, 3]`` with observation
``[18]``, action, log_prob, mask; ``next/agents/{observation, reward, done}``; env-level
``next/{done, terminated, truncated}``. T = 64 steps per fragment. Variants alternate within each repeat
so machine drift hits all alike; the median over repeats is printed as JSON.

    python benchmarks/fragment_assembly.py [--repeats 9] [--envs 64 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tensordict import TensorDict

from core.buffers import FragmentBuilder

T, A, OBS = 64, 3, 18


def make_steps(e: int, g: torch.Generator) -> list[dict]:
    steps = []
    for _ in range(T):
        done = torch.rand(e, 1, generator=g) < 0.02
        steps.append({
            "agents": {"observation": torch.randn(e, A, OBS, generator=g), "action": torch.randint(0, 5, (e, A)),
                       "log_prob": torch.randn(e, A, 1, generator=g), "mask": torch.ones(e, A, dtype=torch.bool)},
            "next": {"agents": {"observation": torch.randn(e, A, OBS, generator=g), "reward": torch.randn(e, A, 1),
                                "done": done.unsqueeze(1).expand(e, A, 1).clone()},
                     "done": done, "terminated": done.clone(), "truncated": torch.zeros(e, 1, dtype=torch.bool)},
        })
    return steps


def builder_fragment(builder: FragmentBuilder, steps: list[dict]) -> float:
    start = time.perf_counter()
    for step in steps:
        builder.add_step_(step)
    builder.build(0)
    return (time.perf_counter() - start) / T * 1e6


def step_td(step: dict, e: int) -> TensorDict:
    nxt = step["next"]
    return TensorDict({
        "agents": TensorDict(step["agents"], batch_size=[e, A]),
        "next": TensorDict({"agents": TensorDict(nxt["agents"], batch_size=[e, A]),
                            **{k: v for k, v in nxt.items() if k != "agents"}}, batch_size=[e]),
    }, batch_size=[e])


def naive_fragment(steps: list[dict], e: int) -> float:
    start = time.perf_counter()
    storage = step_td(steps[0], e).unsqueeze(1).expand(e, T).clone()  # preallocated [E, T] storage
    for t, step in enumerate(steps):
        storage[:, t] = step_td(step, e)
    return (time.perf_counter() - start) / T * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--envs", type=int, nargs="+", default=[64, 1024, 16384])
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for e in args.envs:
        steps = make_steps(e, torch.Generator().manual_seed(e))
        tracked, untracked = FragmentBuilder(e), FragmentBuilder(e, track_episodes=False)
        preallocated = FragmentBuilder(e, fragment_length=T)
        for _ in range(2):  # warm-up: layout capture, allocator
            builder_fragment(tracked, steps), builder_fragment(untracked, steps), naive_fragment(steps, e)
            builder_fragment(preallocated, steps)
        runs = {"builder": [], "builder_preallocated": [], "builder_no_episode_tracking": [],
                "td_per_step_plus_storage_write": []}
        for _ in range(args.repeats):
            runs["builder"].append(builder_fragment(tracked, steps))
            runs["builder_preallocated"].append(builder_fragment(preallocated, steps))
            runs["builder_no_episode_tracking"].append(builder_fragment(untracked, steps))
            runs["td_per_step_plus_storage_write"].append(naive_fragment(steps, e))
        med = {k: round(statistics.median(v), 2) for k, v in runs.items()}
        med["speedup_vs_naive"] = round(med["td_per_step_plus_storage_write"] / med["builder"], 1)
        results[f"envs_{e}"] = med
    print(json.dumps({"unit": "us_per_env_step (add_step_ + build amortised over T)", "T": T, "agents": A,
                      "obs": OBS, "repeats": args.repeats, "torch_threads": 1, "results": results}, indent=2))


if __name__ == "__main__":
    main()
