"""IPPO against MAPPO on mpe2 simple_spread: Shoal's local trainer, same seed and budget, and a random baseline.

Env: ``mpe2:simple_spread_v3`` (``N=3``, ``max_cycles=25``, discrete actions): 3 agents, 25-step episodes (always
truncated, never terminated), one env step = all 3 agents act once. "Team return" = the sum over the 3 agents
of their 25-step reward sums (Shoal's ``episode_return_mean`` / ``eval_return_mean``); the anchors in
``../shared/notes/marl-learning-anchors.md`` section 1 measured: uniform random -81.7, always no-op -75.5,
hand-written MAPPO -64.6 / -70.9 and IPPO -74.3 / -70.3 (seeds 1 / 2) after 300k env steps.

Runs, one after the other in this process (torch 1 thread):

1. uniform random baseline: ``policy_mapping`` sends agent_0..2 to ``"random"``, ``trainer.evaluate(100)``;
2. IPPO: ``PolicyConfig(critic="local")`` (one policy shared by the 3 agents; the critic reads the agent's
   own observation);
3. MAPPO: ``PolicyConfig(critic="central")`` (same actor; the critic reads all agents' observations).

Both learners use :func:`make_config` (the fixed defaults, see there): 16 envs x 50 steps = 800 env steps
(2,400 agent samples) per iteration, 4 epochs of minibatch 200 env steps (600 agent samples), lr 1e-3
annealed linearly to 0 over ``ceil(budget / 800)`` iterations, gamma 0.95, GAE lambda 0.95, clip 0.2, no
entropy bonus, grad-norm 0.5, 64x64 tanh actor and critic. The budget is rounded up to whole iterations.

Per learner the JSON reports: when the mean team return of the last 100 finished training episodes first
reached ``--threshold`` (checked after every iteration once 100 episodes have finished; wall-clock seconds from
before ``build_trainer`` to the end of that iteration, and env steps), and from when on it stayed at or above
the threshold to the end (``stays_above_from``: a first crossing can be an early lucky fluctuation); the final
last-100 training return; a greedy (argmax) evaluation over 100 episodes after training
(``trainer.evaluate(100)``, timed apart from training); env-steps/s over the training loop and over its
collection phases only; and the collect/learn split summed from Shoal's per-iteration ``time_collect`` /
``time_learn``. The PNG at ``--png`` shows both learning curves (last-100 team return against env steps, and
against wall-clock seconds) with the threshold, the random baseline and the final greedy evaluations. The
1-minute load average is logged around each run: timings on a shared 2-core machine are noisy. Before the
timed runs, the random baseline (which also imports mpe2 and the adapters) and two untimed warm-up iterations
per critic load lazily imported code.

    python benchmarks/spread_mappo_ippo.py                    # 150k env steps each, threshold -70
    python benchmarks/spread_mappo_ippo.py --quick            # smoke run: ~5k env steps each
    python benchmarks/spread_mappo_ippo.py --budget 300000 --threshold -65 --seed 2 --png runs/x.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from core.losses import PPOConfig
from core.policies import PolicyConfig
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.builder import build_trainer

ENV = "mpe2:simple_spread_v3"
WINDOW = 100  # Shoal's episode_return_mean is the mean of the last 100 finished training episodes
EVAL_EPISODES = 100
NEVER = 10**9  # eval_every: builds the evaluation actor, but train() never evaluates (we time evaluate() apart)


def make_config(critic: str, *, seed: int, budget: int) -> TrainConfig:
    """The fixed training configuration of this benchmark; only the critic differs between IPPO and MAPPO.

    Args:
        critic: ``"local"`` (IPPO) or ``"central"`` (MAPPO).
        seed: seed of every generator of the run.
        budget: env steps; rounded up to whole 800-step iterations, which is also the annealing horizon.
    """
    rollout = RolloutConfig(num_envs=16, fragment_length=50)  # 800 env steps = 32 episodes per iteration
    iterations = max(1, math.ceil(budget / rollout.steps_per_round))
    return TrainConfig(env=ENV, env_kwargs=(("max_cycles", "25"),), seed=seed, iterations=iterations,
                       lr=1e-3, anneal_lr=True, rollout=rollout, eval_every=NEVER, eval_episodes=EVAL_EPISODES,
                       ppo=PPOConfig(minibatch_size=200, num_epochs=4, gamma=0.95, gae_lambda=0.95),
                       policy=PolicyConfig(critic=critic), device="cpu")


def random_baseline(seed: int, episodes: int) -> dict[str, Any]:
    """Uniformly random actions for all 3 agents, ``episodes`` episodes (sampled, not greedy)."""
    cfg = dataclasses.replace(make_config("local", seed=seed, budget=1),
                              policy_mapping=tuple((f"agent_{i}", "random") for i in range(3)))
    start = time.perf_counter()
    out = build_trainer(cfg).evaluate(episodes)
    return {"eval_return_mean": out["eval_return_mean"], "episodes": episodes,
            "time_s": time.perf_counter() - start}


def train_run(cfg: TrainConfig, threshold: float) -> dict[str, Any]:
    """Trains ``cfg.iterations`` iterations; returns the run's figures and its learning curve."""
    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer = build_trainer(cfg)
    build_s = time.perf_counter() - start
    first = None
    t_collect = t_learn = 0.0
    episodes = 0
    curve: list[tuple[int, float, float]] = []  # (env steps, seconds since start, last-100 team return)
    m: dict[str, float] = {}
    for _ in range(cfg.iterations):
        m = trainer.train()
        now = time.perf_counter() - start
        t_collect += m["time_collect"]
        t_learn += m["time_learn"]
        episodes += int(m["episodes"])
        ret = m["episode_return_mean"]
        curve.append((trainer.env_steps, now, ret))
        if first is None and episodes >= WINDOW and ret >= threshold:
            first = {"time_s": now, "cpu_s": time.process_time() - cpu_start, "env_steps": trainer.env_steps,
                     "iteration": trainer.iteration}
    train_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    # The first-reach time of a noisy 100-episode mean can be a lucky early crossing: also report from when on
    # the curve stayed at or above the threshold until the end (None if it ended below it).
    k = max((i + 1 for i, (_, _, r) in enumerate(curve) if not r >= threshold), default=0)  # NaN counts as below
    held = {"time_s": curve[k][1], "env_steps": curve[k][0], "iteration": k + 1} if k < len(curve) else None
    eval_start = time.perf_counter()
    greedy = trainer.evaluate(EVAL_EPISODES)["eval_return_mean"]
    eval_s = time.perf_counter() - eval_start
    steps = trainer.env_steps
    return {
        "critic": cfg.policy.critic, "reached": first is not None, "first_reach": first,
        "stays_above_from": held,
        "final_train_return_mean_100": m.get("episode_return_mean"),
        "final_train_return_mean_10": m.get("episode_return_mean_10"),
        "final_greedy_eval_return_mean": greedy, "eval_episodes": EVAL_EPISODES, "eval_time_s": eval_s,
        "env_steps": steps, "iterations": trainer.iteration, "episodes": episodes,
        "time_s": train_s, "cpu_s": cpu_s, "time_build_s": build_s,
        "time_collect_s": t_collect, "time_learn_s": t_learn,
        "time_other_s": train_s - build_s - t_collect - t_learn,
        "collect_fraction": t_collect / train_s,
        "env_steps_per_s": steps / train_s, "env_steps_per_s_collect": steps / t_collect,
        "final_entropy": m.get("entropy"), "final_explained_variance": m.get("explained_variance"),
        "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "_curve": curve,
    }


def plot(runs: dict[str, dict[str, Any]], random_return: float, threshold: float, png: Path, title: str) -> Path:
    """Both learning curves against env steps (left) and wall-clock seconds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110, sharey=True)
    colors = {"IPPO": "tab:blue", "MAPPO": "tab:orange"}
    for name, run in runs.items():
        steps, secs, rets = zip(*run["_curve"])
        label = f"{name} (greedy eval {run['final_greedy_eval_return_mean']:.1f})"
        for ax, x in zip(axes, (steps, secs)):
            ax.plot(x, rets, color=colors[name], label=label)
            ax.scatter([x[-1]], [run["final_greedy_eval_return_mean"]], color=colors[name], marker="*", s=120,
                       zorder=3)
    for ax in axes:
        ax.axhline(random_return, color="gray", linestyle=":", label=f"uniform random ({random_return:.1f})")
        ax.axhline(threshold, color="green", linestyle="--", label=f"threshold ({threshold:g})")
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("env steps (3 agent steps each)")
    axes[1].set_xlabel("wall-clock s (incl. build)")
    axes[0].set_ylabel("team return, mean of last 100 training episodes")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    return png


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, float):
        return round(value, 3) if math.isfinite(value) else None
    return value


def _curve_points(curve: list[tuple[int, float, float]], n: int = 10) -> list[list[float]]:
    """About ``n`` evenly spaced points ``[env steps, s, return]`` of a curve, the last one included."""
    idx = sorted({min(len(curve) - 1, round(i * (len(curve) - 1) / max(n - 1, 1))) for i in range(n)})
    return [[curve[i][0], round(curve[i][1], 1), round(curve[i][2], 2)] for i in idx if math.isfinite(curve[i][2])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=150_000, help="env steps per learner (default 150k)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 5k env steps per learner")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threshold", type=float, default=-70.0,
                        help="team return the last-100 training mean must reach (default -70)")
    parser.add_argument("--png", type=Path, default=Path("runs/spread_mappo_ippo.png"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = 5_000 if args.quick else args.budget
    if budget < 1:
        parser.error("--budget must be >= 1")

    random = random_baseline(args.seed, EVAL_EPISODES)  # also warms up imports of mpe2 and the adapters
    for critic in ("local", "central"):  # untimed warm-up: the first PPO update loads lazily imported code
        warm = build_trainer(make_config(critic, seed=10**6, budget=1600))
        warm.train(), warm.train()
    runs = {name: train_run(make_config(critic, seed=args.seed, budget=budget), args.threshold)
            for name, critic in (("IPPO", "local"), ("MAPPO", "central"))}
    cfg = make_config("local", seed=args.seed, budget=budget)
    title = (f"mpe2 simple_spread_v3 (3 agents, 25 steps), seed {args.seed}, {cfg.iterations} x "
             f"{cfg.steps_per_iteration} env steps, Shoal local trainer")
    png = plot(runs, random["eval_return_mean"], args.threshold, args.png, title)
    print(json.dumps({
        "benchmark": "spread_mappo_ippo", "quick": args.quick, "env": ENV, "env_kwargs": dict(cfg.env_kwargs),
        "seed": args.seed, "budget_env_steps": budget, "threshold_team_return": args.threshold,
        "criterion": f"mean team return of the last {WINDOW} finished training episodes >= threshold",
        "hparams": {"num_envs": cfg.rollout.num_envs, "fragment_length": cfg.rollout.fragment_length,
                    "iterations": cfg.iterations, "steps_per_iteration": cfg.steps_per_iteration, "lr": cfg.lr,
                    "anneal_lr": cfg.anneal_lr, **{k: getattr(cfg.ppo, k) for k in (
                        "num_epochs", "minibatch_size", "gamma", "gae_lambda", "clip_eps", "entropy_coef",
                        "value_coef", "max_grad_norm")},
                    "hidden_sizes": list(cfg.policy.hidden_sizes), "activation": cfg.policy.activation},
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "random_baseline": _rounded(random),
        "runs": {name: _rounded(run) for name, run in runs.items()},
        "curves_env_steps_s_return": {name: _curve_points(run["_curve"]) for name, run in runs.items()},
        "png": str(png), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }))


if __name__ == "__main__":
    main()
