"""Sampling throughput of the Ray backend (1 and 2 rollout workers) against the local Actor, same env.

Local: ``Actor.collect()`` in this process (policy act, env step, fragment assembly), fragments dropped.
Ray: the fleet streams (asynchronous mode) into a learner that only takes the data in (fetch + copy, no
training); throughput = env steps of the fragments the learner accepted per second of wall time, after a
warm-up. The workers' pipeline monitors give the per-stage times (ms per fragment): env step, inference,
assembly, waiting on a full queue, serialize+put, waiting for acknowledgements, and the queue depth.
Target: Ray with 1 worker >= 0.8 x local. Variants alternate per repeat so machine drift hits all alike.

Ray on its own starts its worker processes with niceness 15 (``RAY_worker_niceness``) and this driver at 0:
on a machine shared with other busy processes the workers lose CPU to them and the local run does not.
Shoal starts a local Ray with ``RayConfig.worker_niceness`` (0 by default), as this script does;
``--worker-niceness 15`` measures Ray's own default (the variable must be set before Ray starts).

    python benchmarks/ray_sampling.py [--env builtin:cartpole] [--num-envs 64] [--fragment-length 128]
                                      [--seconds 6] [--repeats 3] [--worker-niceness N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import ray
import torch

from orchestration.builder import assignment_for, build_actor, build_policies, build_trainer
from orchestration.config import RayConfig, RolloutConfig, TrainConfig
from orchestration.envs import make_run_env
from orchestration.ray_session import init_ray
from orchestration.statistics import merge_monitors


def local_rate(config: TrainConfig, seconds: float) -> float:
    """Env steps per second of ``Actor.collect()`` in this process."""
    env = make_run_env(config, config.rollout.num_envs)
    assignment = assignment_for(config, env.tree)
    policies, _ = build_policies(config, env.tree, assignment)
    actor = build_actor(config, env, policies, assignment)
    actor.collect()  # warm-up: layout capture, allocator
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        steps += actor.collect().batch_size.numel()
    return steps / (time.perf_counter() - start)


def ray_rate(config: TrainConfig, seconds: float) -> tuple[float, dict]:
    """Env steps per second the learner accepted from a streaming fleet, and the merged pipeline monitors."""
    trainer = build_trainer(config)
    (learner,) = [lrn.handle for lrn in trainer.trainable.values()]
    try:
        trainer.fleet.start(trainer.weights)
        while ray.get(learner.report.remote())["totals"]["accepted"] < 2 * config.rollout.num_workers:
            time.sleep(0.05)  # warm-up: every worker delivered
        trainer.fleet.monitors()  # reset the monitor windows
        start, before = time.perf_counter(), ray.get(learner.report.remote())["totals"]["accepted"]
        time.sleep(seconds)
        after = ray.get(learner.report.remote())["totals"]["accepted"]
        elapsed = time.perf_counter() - start
        monitors = merge_monitors([r["monitor"] for r in trainer.fleet.monitors()])
    finally:
        trainer.close()
    return (after - before) * trainer.fleet.fragment_steps / elapsed, monitors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", default="builtin:cartpole")
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--fragment-length", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker-niceness", type=int, default=None,
                        help="niceness of Ray's workers (default: RayConfig.worker_niceness, 0; Ray's own: 15)")
    args = parser.parse_args()
    if args.worker_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.worker_niceness)
    torch.set_num_threads(1)
    # 2 cores: the worker(s) and the learner share them; reservations would only block scheduling
    ray_config = RayConfig(worker_num_cpus=0, learner_num_cpus=0)
    base = TrainConfig(env=args.env, rollout=RolloutConfig(num_envs=args.num_envs, fragment_length=args.fragment_length),
                       backend="ray", mode="async", max_staleness=10**6, ray=ray_config)
    init_ray(base, ray_config)
    runs: dict[str, list[float]] = {"local": [], "ray_1_worker": [], "ray_2_workers": []}
    stages: dict[str, list[dict]] = {"ray_1_worker": [], "ray_2_workers": []}
    for _ in range(args.repeats):
        runs["local"].append(local_rate(base, args.seconds))
        for n, name in ((1, "ray_1_worker"), (2, "ray_2_workers")):
            config = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, num_workers=n))
            rate, monitors = ray_rate(config, args.seconds)
            runs[name].append(rate)
            stages[name].append(monitors)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    pipeline = {name: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for name, ms in stages.items()}
    print(json.dumps({"benchmark": "ray_sampling", "env": args.env, "num_envs": args.num_envs,
                      "worker_niceness": os.environ.get("RAY_worker_niceness", "15 (Ray's default)"),
                      "fragment_length": args.fragment_length, "seconds": args.seconds, "repeats": args.repeats,
                      "env_steps_per_s": medians, "runs": runs,
                      "ratio_ray_1_worker_vs_local": medians["ray_1_worker"] / medians["local"],
                      "ratio_ray_2_workers_vs_local": medians["ray_2_workers"] / medians["local"], "target": 0.8,
                      "pipeline_ms_per_fragment": pipeline}, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
