"""How long a Ray trainer takes to start, against the floor: its actor processes' imports, side by side.

Ours: ``build_trainer`` of a Ray run (built-in CartPole, ``--workers`` rollout workers and one learner, on a
local Ray instance started once), then ``close``: the build's wall time. Reference, in the same run: the same
actor processes (one learner, the workers, the statistics actor and the checkpoint registry) created at once
as bare actors that only import their modules, awaited together. Every Ray actor is a new Python process that
imports torch and tensordict (seconds each here), so starting them side by side is the most a build can
gain; ``ratio`` = ours / reference (1.0 is the floor). Rounds alternate ours and the reference; medians.

    python benchmarks/ray_startup.py [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ray


@ray.remote(num_cpus=0)
class Importer:
    """A bare actor whose construction imports ``modules`` (what a Shoal actor's process imports)."""

    def __init__(self, modules: list[str]) -> None:
        import importlib

        for module in modules:
            importlib.import_module(module)

    def ready(self) -> bool:
        return True


def reference(workers: int) -> float:
    """Seconds until a learner's, ``workers`` workers' and the two light actors' imports are all done."""
    modules = ([["orchestration.ray_learner"]] + [["orchestration.ray_fleet"]] * workers
               + [["orchestration.statistics"], ["orchestration.learner_checkpoints"]])
    start = time.perf_counter()
    actors = [Importer.remote(m) for m in modules]
    ray.get([a.ready.remote() for a in actors])
    elapsed = time.perf_counter() - start
    for actor in actors:
        ray.kill(actor)
    return elapsed


def ours(workers: int) -> float:
    """Seconds ``build_trainer`` takes for a Ray run with ``workers`` rollout workers."""
    from orchestration.builder import build_trainer
    from orchestration.config import RayConfig, RolloutConfig, TrainConfig

    config = TrainConfig(env="builtin:cartpole", iterations=1, backend="ray", train_batch_size=128,
                         rollout=RolloutConfig(num_envs=4, fragment_length=16, num_workers=workers),
                         ray=RayConfig(worker_num_cpus=0.5, learner_num_cpus=0.5))
    start = time.perf_counter()
    trainer = build_trainer(config)
    elapsed = time.perf_counter() - start
    trainer.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ours(args.workers), reference(args.workers)  # warm-up: Ray's first actors, this process's imports
        builds, floors = [], []
        for _ in range(args.repeats):
            builds.append(ours(args.workers))
            time.sleep(1.0)  # the killed processes exit
            floors.append(reference(args.workers))
            time.sleep(1.0)
    finally:
        ray.shutdown()
    print(json.dumps({
        "benchmark": "ray_startup", "workers": args.workers, "cpus": os.cpu_count(), "repeats": args.repeats,
        "build_trainer_s": round(statistics.median(builds), 2), "imports_side_by_side_s":
            round(statistics.median(floors), 2),
        "ratio": round(statistics.median(b / f for b, f in zip(builds, floors)), 2),
        "build_runs": [round(b, 2) for b in builds], "reference_runs": [round(f, 2) for f in floors]}, indent=1))


if __name__ == "__main__":
    main()
