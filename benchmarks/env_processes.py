"""Slow Python envs in processes: sampling with ``--rollout.env-processes 2`` against one process (same run).

A Shoal actor collects fragments from mpe2 ``simple_spread_v3`` (N envs x T steps, 3 agents) with its envs
either in its own process (``env_processes=0``), split over K ``EnvWorkerPool`` subprocesses stepped in
lock-step, or over K subprocesses polled (``--rollout.env-polling``: the actor acts for whichever processes are
ready while the others step; one round collects K fragments, one per process). Rounds alternate between the
setups (each built once and warmed up); the figure is env-steps/s per setup, median
over rounds, and their ratio. Target (issue "Scale"): >= 1.5x with 2 processes on 2 cores.

    python benchmarks/env_processes.py                    # mpe2 spread, 16 envs, 2 processes
    python benchmarks/env_processes.py --processes 2 4 --num-envs 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from orchestration.builder import assignment_for, build_actor, build_policies
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.envs import make_run_env


def actor_for(config: TrainConfig):
    env = make_run_env(config, config.rollout.num_envs)
    assignment = assignment_for(config, env.tree)
    policies, _ = build_policies(config, env.tree, assignment)
    return build_actor(config, env, policies, assignment)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="mpe2:simple_spread_v3")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--fragment-length", type=int, default=64)
    parser.add_argument("--processes", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = TrainConfig(env=args.env, rollout=RolloutConfig(num_envs=args.num_envs,
                                                          fragment_length=args.fragment_length))
    setups = {"in_process": (actor_for(base), 1)}
    for k in args.processes:
        rollout = dataclasses.replace(base.rollout, env_processes=k)
        setups[f"{k}_processes"] = (actor_for(dataclasses.replace(base, rollout=rollout)), 1)
        polled = dataclasses.replace(rollout, env_polling=True)
        setups[f"{k}_processes_polled"] = (actor_for(dataclasses.replace(base, rollout=polled)), k)
    for actor, fragments in setups.values():
        for _ in range(fragments):
            actor.collect()  # warm-up: imports in the workers, layouts, allocator
    rates: dict[str, list[float]] = {k: [] for k in setups}
    for _ in range(args.rounds):
        for k, (actor, fragments) in setups.items():
            start = time.perf_counter()
            steps = sum(actor.collect().batch_size.numel() for _ in range(fragments))
            rates[k].append(steps / (time.perf_counter() - start))
    for actor, _ in setups.values():
        actor.env.close()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"benchmark": "env_processes", "env": args.env, "num_envs": args.num_envs,
                      "fragment_length": args.fragment_length, "rounds": args.rounds, "env_steps_per_s": medians,
                      "ratios_vs_in_process": {k: v / medians["in_process"] for k, v in medians.items()
                                               if k != "in_process"},
                      "target_2_processes": 1.5, "runs": {k: [round(r) for r in v] for k, v in rates.items()}},
                     indent=1))


if __name__ == "__main__":
    main()
