"""Time to solve CartPole-v1: Shoal's local trainer against a hand-written CleanRL-style PPO, same settings.

Ours: ``build_trainer(replace(load_preset("cartpole"), seed=s))`` (the ``cartpole`` preset, the settings this was
measured with: gymnasium CartPole-v1, 16 envs x 64 steps, lr 2.5e-3 annealed over 100 iterations, 4 epochs of
minibatch 256, no entropy bonus, ...), then ``trainer.train()`` until the criterion holds. Hand:
:func:`handwritten_ppo.run` with the hyper-parameters read from the same config.

Paired runs: with one seed, both sides build the same initial weights, draw the same Gumbel-max action noise
from generators seeded alike and minibatch in the same (env-major) order, and their arithmetic agrees bit for bit
(``tests/orchestration/test_matches_handwritten_ppo.py``), so they follow the same trajectory and meet each
criterion at the same env step (``seeds_same_env_steps``). Which seed is lucky then cancels out of the
per-seed time ratios; their median (``ratio_ours_over_hand_time_per_seed_median``) compares the two
implementations' speed on identical work. (Before pairing, the medians over seeds differed by up to 20% between
halves of 32 seeds, which drowned a 5% speed difference.)

Criteria, checked after every iteration: mean return of the last 10 finished episodes >= ``--stop-return``
(``10``), and of the last 100 (``100``); each needs that many finished episodes. Ours reads Shoal's own metrics
(``episode_return_mean_10``, ``episode_return_mean``); the hand-written PPO keeps the same 100-long window, filled
in the same (env-then-time per iteration) order. One run per (implementation, seed) records when each first
held and goes on until the 100 criterion holds or the cap. The clock starts before the envs and networks are
built (imports and one untimed warm-up run of each side are done first). Runs alternate ours/hand per seed,
the order flipped every other seed. torch uses 1 thread. Prints one JSON; times in seconds: wall-clock (``time_s``) and
this process's CPU time (``cpu_s``, less sensitive to other load on a shared machine).

Cap: ``--max-steps`` (300k), but at most ``iterations * steps_per_iteration`` (102,400 with the defaults): past
``TrainConfig.iterations`` Shoal's annealed learning rate ``lr * (1 - iteration / iterations)`` turns negative
(orchestration/trainer.py ``Trainer.train``). ``--iterations N`` lengthens the annealing horizon of both sides.

    python benchmarks/cartpole_time_to_450.py            # 16 seeds, stop at 450 (~3 min here)
    python benchmarks/cartpole_time_to_450.py --quick    # smoke run: 1 seed, stop at 100
    python benchmarks/cartpole_time_to_450.py --iterations 300   # anneal over 300 iterations (cap 300k steps)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from orchestration.config import TrainConfig
from orchestration.builder import build_trainer
from orchestration.presets import load_preset

try:  # run as a script (benchmarks/ on sys.path) or as a module from the repository root
    from handwritten_ppo import hparams_from_config, run as hand_run
except ImportError:  # pragma: no cover
    from benchmarks.handwritten_ppo import hparams_from_config, run as hand_run

WINDOWS = (10, 100)


def ours_run(cfg: TrainConfig, stop_return: float, max_steps: int, deadline_s: float | None) -> dict[str, Any]:
    """Shoal's local trainer until the last-100 mean reaches ``stop_return`` or a cap (same output as hand_run)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer = build_trainer(cfg)
    build_s = time.perf_counter() - start
    first: dict[int, dict[str, float]] = {}
    t_collect = t_learn = 0.0
    episodes = 0
    m: dict[str, float] = {}
    while True:
        m = trainer.train()
        t_collect += m["time_collect"]
        t_learn += m["time_learn"]
        episodes += int(m["episodes"])
        # Shoal's own metrics: mean of the last 10 / last 100 finished episodes (Trainer._episodes).
        means = {10: m["episode_return_mean_10"], 100: m["episode_return_mean"]}
        for w in WINDOWS:
            if w not in first and episodes >= w and means[w] >= stop_return:
                first[w] = {"time_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start,
                            "env_steps": trainer.env_steps, "iteration": trainer.iteration}
        out_of_time = deadline_s is not None and time.perf_counter() - start > deadline_s
        if 100 in first or trainer.env_steps >= max_steps or out_of_time:
            break
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "time_s": elapsed, "cpu_s": cpu, "env_steps": trainer.env_steps, "reached": 100 in first,
        "iterations": trainer.iteration, "episodes": episodes, "first": {str(w): v for w, v in sorted(first.items())},
        "return_mean_10": m["episode_return_mean_10"], "return_mean_100": m["episode_return_mean"],
        "time_sample_s": t_collect, "time_update_s": t_learn, "time_build_s": build_s,
    }


def _rounded(result: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in result.items():
        if isinstance(v, dict):
            out[k] = _rounded(v)
        elif isinstance(v, float):
            out[k] = round(v, 3) if math.isfinite(v) else None
        else:
            out[k] = v
    return out


def _median(values: list[float]) -> float | None:
    """Median with unreached runs as +inf (so a median over mostly-unreached seeds is None, not a low number)."""
    m = statistics.median(values) if values else math.inf
    return round(m, 3) if math.isfinite(m) else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per criterion: medians over seeds of time and steps, and the ours/hand time ratios."""
    out: dict[str, Any] = {}
    for w in map(str, WINDOWS):
        crit: dict[str, Any] = {}
        for side in ("ours", "hand"):
            hits = [r[side]["first"].get(w) for r in runs]
            crit[f"{side}_reached"] = sum(h is not None for h in hits)
            crit[f"{side}_time_s_median"] = _median([h["time_s"] if h else math.inf for h in hits])
            crit[f"{side}_cpu_s_median"] = _median([h["cpu_s"] if h else math.inf for h in hits])
            crit[f"{side}_env_steps_median"] = _median([h["env_steps"] if h else math.inf for h in hits])
        pairs = [(r["ours"]["first"].get(w), r["hand"]["first"].get(w)) for r in runs]
        crit["ratio_ours_over_hand_time_per_seed"] = [round(o["time_s"] / h["time_s"], 3) if o and h else None
                                                      for o, h in pairs]
        ratios = [o["time_s"] / h["time_s"] for o, h in pairs if o and h]
        crit["ratio_ours_over_hand_time_per_seed_median"] = round(statistics.median(ratios), 3) if ratios else None
        crit["seeds_same_env_steps"] = sum(  # paired runs: the same trajectory, so the same step
            bool(o and h and o["env_steps"] == h["env_steps"]) for o, h in pairs)
        crit["seeds_ours_sooner"] = sum(  # per seed, who met the criterion first (unreached: never)
            (o["time_s"] if o else math.inf) < (h["time_s"] if h else math.inf) for o, h in pairs)
        o_med, h_med = crit["ours_time_s_median"], crit["hand_time_s_median"]
        crit["ratio_ours_over_hand_time_median"] = round(o_med / h_med, 3) if o_med and h_med else None
        o_med, h_med = crit["ours_cpu_s_median"], crit["hand_cpu_s_median"]
        crit["ratio_ours_over_hand_cpu_median"] = round(o_med / h_med, 3) if o_med and h_med else None
        out[w] = crit
    # Throughput over whole runs (independent of how many steps a seed happened to need).
    for side in ("ours", "hand"):
        steps = sum(r[side]["env_steps"] for r in runs)
        out[f"{side}_env_steps_per_s_overall"] = round(steps / sum(r[side]["time_s"] for r in runs))
        out[f"{side}_env_steps_per_cpu_s_overall"] = round(steps / sum(r[side]["cpu_s"] for r in runs))
        out[f"{side}_sample_s_per_1k_steps"] = round(1e3 * sum(r[side]["time_sample_s"] for r in runs) / steps, 4)
        out[f"{side}_update_s_per_1k_steps"] = round(1e3 * sum(r[side]["time_update_s"] for r in runs) / steps, 4)
    out["ratio_ours_over_hand_s_per_step"] = round(
        (out["hand_env_steps_per_s_overall"] / out["ours_env_steps_per_s_overall"]), 3)
    out["ratio_ours_over_hand_cpu_s_per_step"] = round(
        (out["hand_env_steps_per_cpu_s_overall"] / out["ours_env_steps_per_cpu_s_overall"]), 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, stop return 100, 60k-step cap")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 17)),
                        help="seeds (16 by default: paired runs take the same steps, so only the machine's "
                             "noise is left in the per-seed time ratios)")
    parser.add_argument("--stop-return", type=float, default=450.0)
    parser.add_argument("--max-steps", type=int, default=300_000)
    parser.add_argument("--iterations", type=int, default=None,
                        help="annealing horizon of both sides (default: the cartpole preset's, 100)")
    parser.add_argument("--deadline", type=float, default=600.0, help="wall-clock cap per run, s")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds, stop, max_steps = (args.seeds[:1], 100.0, 60_000) if args.quick else (args.seeds, args.stop_return,
                                                                                  args.max_steps)
    base = load_preset("cartpole")
    base = base if args.iterations is None else replace(base, iterations=args.iterations)
    cap = min(max_steps, base.iterations * base.steps_per_iteration) if base.anneal_lr else max_steps
    hp = hparams_from_config(base)

    # Warm-up (untimed): first calls load kernels and lazily imported modules on both sides.
    ours_run(replace(base, seed=10**6), math.inf, 2 * base.steps_per_iteration, None)
    hand_run(hp, seed=10**6, stop_return=math.inf, max_steps=2 * base.steps_per_iteration, window=100)

    def ours(seed):
        return ours_run(replace(base, seed=seed), stop, cap, args.deadline)

    def hand(seed):
        return hand_run(hp, seed=seed, stop_return=stop, max_steps=cap, window=100, deadline_s=args.deadline)

    runs = []
    for k, seed in enumerate(seeds):
        order = (("ours", ours), ("hand", hand)) if k % 2 == 0 else (("hand", hand), ("ours", ours))
        entry: dict[str, Any] = {"seed": seed}
        for name, fn in order:
            load_before = os.getloadavg()[0]
            entry[name] = fn(seed)
            entry[name]["loadavg_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        runs.append(entry)

    print(json.dumps({
        "benchmark": "cartpole_time_to_450", "quick": args.quick, "env": base.env, "stop_return": stop,
        "seeds": seeds, "step_cap": cap, "anneal_iterations": base.iterations,
        "steps_per_iteration": base.steps_per_iteration, "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "hparams": {k: list(v) if isinstance(v, tuple) else v for k, v in hp.items()},
        "summary": summarize(runs),
        "runs": [{"seed": r["seed"], "ours": _rounded(r["ours"]), "hand": _rounded(r["hand"])} for r in runs],
    }))


if __name__ == "__main__":
    main()
