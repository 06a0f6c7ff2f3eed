"""Self-play throughput on PettingZoo connect four: a league pool of 1, 8 and 64 snapshots vs one fixed opponent.

Every variant is the same sub-trainer, ``TrainConfig(env="pettingzoo:classic.connect_four_v3",
policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",))``, synchronous, local backend,
``--num-envs`` x ``--fragment-length`` env steps per actor per iteration (defaults: 16 x 32, one actor):

- ``fixed``: ``trainer.train()`` against the initial ``opponent`` weights, never swapped;
- ``pool_K``: a :class:`orchestration.league.LeagueTrainer` whose pool holds K frozen members (its initial
  member plus K - 1 perturbed copies of the learner, added with :meth:`LeagueTrainer.add_member`), drawing a
  member by PFSP and swapping it into the actors before every iteration, as in training. ``snapshot_every``
  is set past the run, so the pool stays at K while it is measured.

Reported per variant (median over ``--repeats``; each repeat runs ``--iterations`` iterations of every
variant, interleaved iteration by iteration in a rotating order, so the machine's load and the learners'
progress hit all variants alike): games/s and env-steps/s per wall second of the ``train()`` calls (collect +
learn + the league's swap and bookkeeping: "train-included") and per collect second (``time_collect`` from the
trainer's metrics: "sampling-only"); the split of the iteration time into collect / learn / swap / the rest;
and, for the leagues, the swaps per iteration, the seconds per swap, and the opponent weight copies into
actors per iteration and per game (counted by wrapping every actor's ``set_weights``). A swap copies the
member's weights into the fixed opponent "learner" (its module, then its published copy) and once into each
actor, once per iteration, whatever the number of games. Every iteration collects the same env steps, so env-
steps/s compares the machinery; games/s also moves with the game length, which depends on who plays whom (each
variant's learner trains against its own opponents, and a perturbed copy plays differently from the initial
weights). The JSON's ``opponent_copies_into_actors_per_iteration`` should equal the number of actors (``--num-
workers``) for a league and 0 for ``fixed``; the learner's new weights reach the actors the same way, once per
iteration (``learner_copies_into_actors_per_iteration``), in every variant.

    python benchmarks/selfplay_throughput.py                       # about 50 s on 2 cores
    python benchmarks/selfplay_throughput.py --repeats 5 --iterations 10 --num-envs 32 --pools 1 8 64 256
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
from orchestration.league import LeagueTrainer

ENV = "pettingzoo:classic.connect_four_v3"


class Variant:
    """One trainer (plain or league), with counters for the swaps and the copies into actors."""

    def __init__(self, name: str, config: TrainConfig, pool: int | None, seed: int) -> None:
        self.name, self.pool_size = name, pool
        self.trainer = build_trainer(config)
        self.swaps, self.swap_s = 0, 0.0
        self.actor_copies = {"player": 0, "opponent": 0}
        for actor in self.trainer.fleet.actors:  # count the copies into actors (skipped ones return False)
            actor.set_weights = self._counting(actor.set_weights)
        if pool is None:
            self.league = None
            self.step = self.trainer.train
            return
        self.league = LeagueTrainer(self.trainer, learner="player", opponent="opponent", snapshot_every=10**9,
                                    seed=seed)
        source = self.trainer.learners["player"].weights()[1]
        g = torch.Generator().manual_seed(seed)
        for _ in range(pool - 1):
            self.league.add_member(source.apply(lambda t: t + 0.05 * torch.randn(t.shape, generator=g)))
        assert len(self.league.pool) == pool
        set_weights = self.trainer.set_weights

        def timed_set_weights(policy_id, weights):
            start = time.perf_counter()
            out = set_weights(policy_id, weights)
            self.swap_s += time.perf_counter() - start
            self.swaps += 1
            return out

        self.trainer.set_weights = timed_set_weights
        self.step = self.league.train

    def _counting(self, set_weights):
        def counted(policy_id, *args, **kwargs):
            copied = set_weights(policy_id, *args, **kwargs)
            self.actor_copies[policy_id] += int(bool(copied))
            return copied
        return counted

    def start(self) -> None:
        """Opens a measurement window (one repeat)."""
        self.window = {"games": 0, "wall_s": 0.0, "collect_s": 0.0, "learn_s": 0.0, "drawn": set(),
                       "marks": (self.swaps, self.swap_s, dict(self.actor_copies), self.trainer.env_steps)}

    def iterate(self) -> None:
        """One timed ``train()`` iteration, added to the window."""
        w = self.window
        start = time.perf_counter()
        metrics = self.step()
        w["wall_s"] += time.perf_counter() - start
        w["games"] += int(metrics["episodes"])
        w["collect_s"] += metrics["time_collect"]
        w["learn_s"] += metrics["time_learn"]
        if self.league is not None:
            w["drawn"].add(int(metrics["league_opponent"]))

    def finish(self) -> dict:
        """Closes the window: its totals."""
        w = self.window
        swaps, swap_s, copies, steps = w.pop("marks")
        return {"games": w["games"], "env_steps": self.trainer.env_steps - steps, "wall_s": w["wall_s"],
                "collect_s": w["collect_s"], "learn_s": w["learn_s"], "swap_s": self.swap_s - swap_s,
                "swaps": self.swaps - swaps, "distinct_opponents": len(w.pop("drawn")),
                "opponent_copies_into_actors": self.actor_copies["opponent"] - copies["opponent"],
                "learner_copies_into_actors": self.actor_copies["player"] - copies["player"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=12, help="iterations per variant per repeat")
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--fragment-length", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=1, help="actors (local backend: stepped in turn)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = TrainConfig(env=ENV, seed=args.seed, iterations=10**6, lr=1e-3,
                         policy_mapping=(("player_1", "opponent"),), fixed_policies=("opponent",),
                         rollout=RolloutConfig(num_envs=args.num_envs, fragment_length=args.fragment_length,
                                               num_workers=args.num_workers),
                         ppo=PPOConfig(minibatch_size=min(128, args.num_envs * args.fragment_length)))
    variants = [Variant("fixed", config, None, args.seed)]
    variants += [Variant(f"pool_{k}", config, k, args.seed) for k in args.pools]
    steps_per_iteration = args.num_envs * args.fragment_length * args.num_workers
    for v in variants:  # warm-up: first forward/backward, allocator
        v.start()
        v.iterate()
        v.finish()
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    for r in range(args.repeats):  # iteration by iteration round-robin: load bursts hit every variant alike
        for v in variants:
            v.start()
        for i in range(args.iterations):
            k = (r * args.iterations + i) % len(variants)
            for v in variants[k:] + variants[:k]:
                v.iterate()
        for v in variants:
            runs[v.name].append(v.finish())

    def med(name: str, f) -> float:
        return statistics.median(f(r) for r in runs[name])

    summary = {}
    for v in variants:
        n = v.name
        row = {
            "pool_size": v.pool_size,
            "games_per_s": med(n, lambda r: r["games"] / r["wall_s"]),
            "env_steps_per_s": med(n, lambda r: r["env_steps"] / r["wall_s"]),
            "sampling_games_per_s": med(n, lambda r: r["games"] / r["collect_s"]),
            "sampling_env_steps_per_s": med(n, lambda r: r["env_steps"] / r["collect_s"]),
            "games_per_iteration": med(n, lambda r: r["games"] / args.iterations),
            "iteration_ms": med(n, lambda r: 1e3 * r["wall_s"] / args.iterations),
            "collect_ms_per_iteration": med(n, lambda r: 1e3 * r["collect_s"] / args.iterations),
            "learn_ms_per_iteration": med(n, lambda r: 1e3 * r["learn_s"] / args.iterations),
            "swap_ms_per_iteration": med(n, lambda r: 1e3 * r["swap_s"] / args.iterations),
            "other_ms_per_iteration": med(n, lambda r: 1e3 * (r["wall_s"] - r["collect_s"] - r["learn_s"]
                                                              - r["swap_s"]) / args.iterations),
            "swaps_per_iteration": med(n, lambda r: r["swaps"] / args.iterations),
            "opponent_copies_into_actors_per_iteration": med(n, lambda r: r["opponent_copies_into_actors"]
                                                             / args.iterations),
            "opponent_copies_into_actors_per_game": med(n, lambda r: r["opponent_copies_into_actors"]
                                                        / max(r["games"], 1)),
            "learner_copies_into_actors_per_iteration": med(n, lambda r: r["learner_copies_into_actors"]
                                                            / args.iterations),
        }
        if v.league is not None:
            row["ms_per_swap"] = med(n, lambda r: 1e3 * r["swap_s"] / max(r["swaps"], 1))
            row["distinct_opponents_per_repeat_median"] = med(n, lambda r: r["distinct_opponents"])
            row["pool_size_at_end"] = len(v.league.pool)
        summary[n] = row
    fixed = summary["fixed"]
    ratios = {n: {"env_steps_per_s": s["env_steps_per_s"] / fixed["env_steps_per_s"],
                  "sampling_env_steps_per_s": s["sampling_env_steps_per_s"] / fixed["sampling_env_steps_per_s"],
                  "games_per_s": s["games_per_s"] / fixed["games_per_s"],
                  "sampling_games_per_s": s["sampling_games_per_s"] / fixed["sampling_games_per_s"]}
              for n, s in summary.items() if n != "fixed"}
    print(json.dumps({"benchmark": "selfplay_throughput", "env": ENV, "mode": config.mode, "backend": config.backend,
                      "num_envs": args.num_envs, "fragment_length": args.fragment_length,
                      "num_workers": args.num_workers, "env_steps_per_iteration": steps_per_iteration,
                      "iterations_per_repeat": args.iterations, "repeats": args.repeats, "threads": args.threads,
                      "summary": summary, "ratio_over_fixed": ratios,
                      "runs": runs}, indent=1))
    for v in variants:
        v.trainer.close()


if __name__ == "__main__":
    main()
