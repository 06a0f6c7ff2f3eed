"""Self-play on connect four with and without past selves: win rates against a uniformly random player.

Trains the same config twice (seed, budget, settings), once with plain self-play (``past_selves.fraction 0``)
and once with past selves (``orchestration.past_selves``), and every ``--every`` iterations plays the policy
greedily in each seat against a random legal-move player (``orchestration.matches.play_seats``, ``--games``
games per seat). Prints one JSON line per checkpoint and a final JSON summary. A run of the defaults takes
about 5 minutes on 2 cores.

    python benchmarks/self_play_vs_random.py [--iterations 150] [--every 30] [--games 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from core.losses import PPOConfig
from orchestration.builder import build_trainer
from orchestration.checkpoint import save_checkpoint
from orchestration.config import PastSelvesConfig, RolloutConfig, TrainConfig
from orchestration.matches import play_seats
from orchestration.run_state import trainer_state

ENV = "pettingzoo:classic.connect_four_v3"


def run(fraction: float, args) -> list[dict]:
    config = TrainConfig(env=ENV, seed=args.seed, iterations=args.iterations, lr=2.5e-3, loggers=(),
                         rollout=RolloutConfig(num_envs=16, fragment_length=64),
                         ppo=PPOConfig(minibatch_size=256, entropy_coef=0.01),
                         past_selves=PastSelvesConfig(fraction=fraction))
    trainer, directory, rows, start = build_trainer(config), tempfile.mkdtemp(), [], time.perf_counter()
    for iteration in range(1, args.iterations + 1):
        metrics = trainer.train()
        if iteration % args.every == 0 or iteration == args.iterations:
            weights, tensors, state = trainer_state(trainer)
            checkpoint = save_checkpoint(directory, iteration, weights=weights, tensors=tensors, state=state)
            seats = play_seats(str(checkpoint), "random", episodes=args.games, env=ENV, seed=args.seed)
            row = {"past_selves": fraction, "iteration": iteration, "env_steps": iteration * 1024,
                   "win_rate": {seat: r["win"] for seat, r in seats.items()},
                   "entropy": round(float(metrics.get("entropy", float("nan"))), 4),
                   "seconds": round(time.perf_counter() - start, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    trainer.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--games", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain, past = run(0.0, args), run(0.5, args)
    print(json.dumps({"benchmark": "self_play_vs_random", "env": ENV, "games_per_seat": args.games,
                      "final": {"plain": plain[-1]["win_rate"], "past_selves": past[-1]["win_rate"]},
                      "worst_seat": {"plain": min(plain[-1]["win_rate"].values()),
                                     "past_selves": min(past[-1]["win_rate"].values())}}))


if __name__ == "__main__":
    main()
