"""The learning table: every shipped preset trained over its fixed env-step budget, a few seeds, against a uniformly
random policy measured in the same run, with published reference figures beside them.

Per task and seed: ``load_preset(preset)`` with ``seed=s`` and ``iterations`` scaled by ``--budget-scale`` (the
learning rate anneals over the scaled budget), ``trainer.train()`` for every iteration, then a greedy (mode of the
policy) evaluation over ``EPISODES[task]`` episodes on separate envs (``trainer.evaluate``): its mean return is the
seed's figure. Two tasks measure something else:

- ``connect_four`` (self-play, zero-sum: the return is 0 by construction): the greedy win rate against a uniformly
  random opponent, averaged over both seats (``orchestration.matches.play_seats``); its "random" column is the
  untrained policy sampling (near-uniform over legal moves) against the same opponent;
- ``spread_*`` and ``navigation``: the team return, the sum over the agents (Shoal's ``eval_return_mean``).

The random column: the same env with every agent mapped to Shoal's built-in ``random`` policy (uniform over the
legal actions, uniform in a box's bounds), evaluated over the same episodes per seed. Reported per task: the mean
over seeds and its 95% interval (Student t, ``seeds - 1`` degrees of freedom; "n/a" with one seed), each seed's
figure, env steps per seed, and wall-clock seconds. A task whose environment family is not installed is skipped
with the reason (e.g. ``lunarlander`` without Box2D); a task that raises is reported as failed, with its error,
and the others go on.

Reference figures (different budgets and evaluation protocols; beside ours for orientation, not as a match):

- CleanRL ``ppo.py``, average episodic training return over 3 seeds after 500k steps
  (https://docs.cleanrl.dev/rl-algorithms/ppo/#experiment-results): CartPole-v1 492.40 +- 13.05,
  Acrobot-v1 -89.93 +- 6.34;
- RL Baselines3 Zoo's PPO, one trained agent evaluated deterministically
  (https://github.com/DLR-RM/rl-baselines3-zoo/blob/master/benchmark.md): CartPole-v1 500.0 (100k steps),
  Acrobot-v1 -73.5 (1M), Pendulum-v1 -172.2 +- 104.2 (100k), LunarLander-v2 242.1 +- 31.8 (1M);
- simple_spread, VMAS navigation (BenchMARL reports them with other settings and scales), connect_four,
  and Shoal's built-in tasks: none ("n/a").

Prints one JSON, then the markdown table (also written to ``--markdown`` when given). torch uses 1 thread.

    python benchmarks/learning_table.py                                   # every task, 3 seeds (~30-40 min here)
    python benchmarks/learning_table.py --budget-scale 0.1 --seeds 1      # smoke run (~3 min)
    python benchmarks/learning_table.py --tasks cartpole acrobot pendulum recall --markdown table.md
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import statistics
import tempfile
import time
from typing import Any

import torch

from core.specs import agent_index
from orchestration.builder import build_trainer
from orchestration.presets import load_preset

CLEANRL = "https://docs.cleanrl.dev/rl-algorithms/ppo/#experiment-results"
ZOO = "https://github.com/DLR-RM/rl-baselines3-zoo/blob/master/benchmark.md"

TASKS: dict[str, dict[str, Any]] = {  # task -> preset, needed module, metric, published references
    "cartpole": {"preset": "cartpole", "needs": None, "metric": "greedy return",
                 "refs": [("CleanRL ppo.py, 500k", "492.4 ± 13.1", CLEANRL), ("SB3 zoo PPO, 100k", "500.0", ZOO)]},
    "acrobot": {"preset": "acrobot", "needs": None, "metric": "greedy return",
                "refs": [("CleanRL ppo.py, 500k", "-89.9 ± 6.3", CLEANRL), ("SB3 zoo PPO, 1M", "-73.5", ZOO)]},
    "pendulum": {"preset": "pendulum", "needs": None, "metric": "greedy return",
                 "refs": [("SB3 zoo PPO, 100k", "-172.2 ± 104.2", ZOO)]},
    "lunarlander": {"preset": "lunarlander", "needs": "Box2D", "metric": "greedy return",
                    "refs": [("SB3 zoo PPO (v2), 1M", "242.1 ± 31.8", ZOO)]},
    "spread_ippo": {"preset": "spread_ippo", "needs": "mpe2", "metric": "greedy team return", "refs": []},
    "spread_mappo": {"preset": "spread_mappo", "needs": "mpe2", "metric": "greedy team return", "refs": []},
    "navigation": {"preset": "navigation", "needs": "vmas", "metric": "greedy team return", "refs": []},
    "connect_four": {"preset": "connect_four", "needs": "pygame", "metric": "win rate vs random", "refs": []},
    "recall": {"preset": "recall", "needs": None, "metric": "greedy hit rate", "refs": []},
    "spot": {"preset": "spot", "needs": None, "metric": "greedy hit rate", "refs": []},
}
EPISODES = {"cartpole": 10, "acrobot": 10, "pendulum": 10, "lunarlander": 10, "spread_ippo": 50, "spread_mappo": 50,
            "navigation": 64, "connect_four": 50, "recall": 256, "spot": 256}
EXTRAS = {"Box2D": "box2d", "mpe2": "mpe2", "vmas": "vmas", "pygame": "classic"}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def interval(values: list[float]) -> dict[str, Any]:
    """Mean and the half-width of its 95% Student-t interval (None with one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "ci95": None}
    t = T_975.get(len(values) - 1, 1.96)
    return {"mean": mean, "ci95": t * statistics.stdev(values) / math.sqrt(len(values))}


def win_rate_vs_random(trainer, episodes: int, seed: int, sample: bool) -> float:
    """Mean over seats of the win rate of the trainer's newest weights against the ``random`` policy."""
    from orchestration.checkpoint import save_checkpoint
    from orchestration.matches import play_seats
    from orchestration.run_state import trainer_state

    with tempfile.TemporaryDirectory() as directory:
        weights, tensors, state = trainer_state(trainer)
        save_checkpoint(directory, trainer.iteration, weights=weights, tensors=tensors, state=state)
        seats = play_seats(directory, "random", episodes=episodes, env=trainer.config.env, sample=sample, seed=seed)
    return statistics.fmean(r["win"] for r in seats.values())


def run_seed(task: str, seed: int, scale: float) -> dict[str, Any]:
    """One seed of ``task``: the trained figure, the random baseline's, env steps and seconds."""
    preset = load_preset(TASKS[task]["preset"])
    iterations = max(1, round(preset.iterations * scale))
    config = dataclasses.replace(preset, seed=seed, iterations=iterations, eval_every=iterations + 1,
                                 eval_episodes=EPISODES[task], loggers=())
    start = time.perf_counter()
    trainer = build_trainer(config)
    try:
        if task == "connect_four":
            baseline = win_rate_vs_random(trainer, EPISODES[task], seed, sample=True)
        while trainer.iteration < iterations:
            trainer.train()
        train_s = time.perf_counter() - start
        if task == "connect_four":
            figure = win_rate_vs_random(trainer, EPISODES[task], seed, sample=False)
        else:
            figure = trainer.evaluate()["eval_return_mean"]
        steps, agents = trainer.env_steps, list(agent_index(trainer.tree))
    finally:
        trainer.close()
    if task != "connect_four":
        uniform = dataclasses.replace(config, policy_mapping=tuple((a, "random") for a in agents), iterations=0)
        randoms = build_trainer(uniform)
        try:
            baseline = randoms.evaluate()["eval_return_mean"]
        finally:
            randoms.close()
    return {"figure": float(figure), "random": float(baseline), "env_steps": int(steps), "train_s": train_s}


def markdown(results: dict[str, Any], skipped: dict[str, str]) -> str:
    def fmt(summary: dict[str, Any]) -> str:
        ci = summary["ci95"]
        return f"{summary['mean']:.2f}" + (f" ± {ci:.2f}" if ci is not None else "")

    lines = ["| task | preset env | metric | env steps | Shoal (mean ± 95% CI) | random | reference |",
             "|---|---|---|---:|---:|---:|---|"]
    for task, r in results.items():
        refs = "; ".join(f"{value} ([{label}]({url}))" for label, value, url in TASKS[task]["refs"]) or "n/a"
        lines.append(f"| {task} | `{r['env']}` | {r['metric']} | {r['env_steps']:,} | {fmt(r['shoal'])} | "
                     f"{fmt(r['random'])} | {refs} |")
    for task, why in skipped.items():
        lines.append(f"| {task} | `{load_preset(TASKS[task]['preset']).env}` | {why} | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per task (0, 1, ...)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplier of every preset's iterations")
    parser.add_argument("--markdown", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results, skipped = {}, {}
    for task in args.tasks:
        needs = TASKS[task]["needs"]
        if needs and importlib.util.find_spec(needs) is None:
            skipped[task] = f"skipped: {needs} is not installed (pip install 'shoal[{EXTRAS[needs]}]')"
            continue
        try:
            runs = [run_seed(task, seed, args.budget_scale) for seed in range(args.seeds)]
        except Exception as err:  # one task's failure (an env family's bug) keeps the others' figures
            skipped[task] = f"failed: {type(err).__name__}: {err}"
            print(f"# {task}: {skipped[task]}", flush=True)
            continue
        results[task] = {
            "env": load_preset(TASKS[task]["preset"]).env, "preset": TASKS[task]["preset"],
            "metric": TASKS[task]["metric"], "env_steps": runs[0]["env_steps"],
            "shoal": interval([r["figure"] for r in runs]), "random": interval([r["random"] for r in runs]),
            "per_seed": [round(r["figure"], 3) for r in runs], "train_s": [round(r["train_s"], 1) for r in runs],
            "references": [{"source": label, "value": value, "url": url} for label, value, url in TASKS[task]["refs"]],
        }
        print(f"# {task}: {results[task]['shoal']} (random {results[task]['random']['mean']:.2f})", flush=True)
    table = markdown(results, skipped)
    print(json.dumps({"seeds": args.seeds, "budget_scale": args.budget_scale, "torch_threads": 1,
                      "tasks": results, "skipped": skipped}, indent=1))
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
