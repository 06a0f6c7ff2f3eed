"""Asynchronous PPO in one process against synchronous PPO, on the built-in torch CartPole (same run).

Both sides: ``TrainConfig(env="builtin:cartpole", train_batch_size=1024)`` with 2 actors x 16 envs x 64 steps,
everything else default. Sync collects one round (a fragment from each actor: 2,048 env steps, the least that
covers the batch) with the current weights and trains once on all of it; async produces the same rounds but
trains whenever 1,024 fresh env steps are ready, so it makes two updates per round and the second one trains
on data one version old (``trained_max_lag``), as on a real asynchronous fleet. In one process nothing runs concurrently: this
measures the cost of the asynchronous rules (staleness checks, reuse, serial interleaving), not a speed-up.

Reported per mode (median over seeds, runs interleaved sync/async per seed, order flipped every other seed):
time and env steps until the mean return of the last 10 episodes reaches ``--stop-return`` (450), and
env-steps/s over the whole run (collect + learn).

    python benchmarks/async_vs_sync.py               # 8 seeds
    python benchmarks/async_vs_sync.py --seeds 2     # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from core.losses import PPOConfig
from orchestration.builder import build_trainer
from orchestration.config import RolloutConfig, TrainConfig


def run(config: TrainConfig, stop_return: float, max_steps: int) -> dict:
    start = time.perf_counter()
    trainer = build_trainer(config)
    reached = None
    metrics: dict = {}
    while trainer.env_steps < max_steps:
        metrics = trainer.train()
        if reached is None and metrics["episode_return_mean_10"] >= stop_return:
            reached = {"time_s": time.perf_counter() - start, "env_steps": trainer.env_steps}
            break
    elapsed = time.perf_counter() - start
    trainer.close()
    return {"reached": reached, "env_steps": trainer.env_steps, "time_s": elapsed,
            "env_steps_per_s": trainer.env_steps / elapsed, "trained_max_lag": metrics.get("trained_max_lag"),
            "fragments_stale": metrics.get("fragments_stale")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--stop-return", type=float, default=450.0)
    parser.add_argument("--max-steps", type=int, default=300_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = TrainConfig(env="builtin:cartpole", iterations=300, train_batch_size=1024, lr=2.5e-3,  # as measured
                       ppo=PPOConfig(minibatch_size=256, entropy_coef=0.0),
                       rollout=RolloutConfig(num_envs=16, fragment_length=64, num_workers=2))
    run(base, 1e9, 4096)  # warm-up: imports, allocator
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for seed in range(args.seeds):
        order = ("sync", "async") if seed % 2 == 0 else ("async", "sync")
        for mode in order:
            config = TrainConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "seed": seed,
                                    "mode": mode})
            results[mode].append(run(config, args.stop_return, args.max_steps))
    summary = {}
    for mode, runs in results.items():
        solved = [r["reached"] for r in runs if r["reached"]]
        summary[mode] = {"solved": f"{len(solved)}/{len(runs)}",
                         "time_to_stop_return_s_median": statistics.median(r["time_s"] for r in solved) if solved else None,
                         "env_steps_to_stop_return_median": statistics.median(r["env_steps"] for r in solved) if solved else None,
                         "env_steps_per_s_median": statistics.median(r["env_steps_per_s"] for r in runs),
                         "trained_max_lag_max": max(r["trained_max_lag"] or 0 for r in runs)}
    ratio = summary["async"]["env_steps_per_s_median"] / summary["sync"]["env_steps_per_s_median"]
    print(json.dumps({"benchmark": "async_vs_sync", "env": base.env, "seeds": args.seeds,
                      "stop_return": args.stop_return, "summary": summary,
                      "ratio_async_over_sync_env_steps_per_s": ratio,
                      "runs": {m: [{k: v for k, v in r.items()} for r in rs] for m, rs in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
