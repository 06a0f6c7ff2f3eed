"""One slow env process: lock-step sampling (Actor on an EnvWorkerPool) against polling (PollingActor), same run.

K CartPole processes of N envs each; every env step sleeps ``--fast-ms``, except in process K-1, which sleeps
``--slow-factor`` times longer (a slow simulator, a loaded node). The lock-step actor waits for every process
at every step, so all of them run at the slow one's pace; the polling actor serves whichever processes are
ready. Rounds alternate between the two setups (each built once and warmed up), each round runs for
``--round-s`` seconds; the figure is env steps/s per setup (median over rounds) and their ratio, plus the
share of steps each process made under polling.

    python benchmarks/env_polling.py                          # 4 processes x 4 envs, 2 ms vs 20 ms a step
    python benchmarks/env_polling.py --processes 8 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from adapters.builtin import CartPole, CartPoleConfig
from adapters.env_worker import EnvWorkerPool
from core.policies import make_policies
from orchestration.actor import Actor
from orchestration.assignment import assign
from orchestration.polling_actor import PollingActor


class SleepyCartPole(CartPole):
    """CartPole whose every step sleeps ``delay_s`` (module level: the worker processes import it)."""

    def __init__(self, num_envs: int, delay_s: float) -> None:
        super().__init__(CartPoleConfig(num_envs=num_envs))
        self._delay = delay_s

    def step(self, actions):
        time.sleep(self._delay)
        return super().step(actions)


def run_for(actor, seconds: float) -> float:
    """Collects fragments for about ``seconds``; returns env steps per second (steps the actor recorded)."""
    before, start = actor.env_steps, time.perf_counter()
    while time.perf_counter() - start < seconds:
        actor.collect()
    return (actor.env_steps - before) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--num-envs", type=int, default=4, help="envs per process")
    parser.add_argument("--fast-ms", type=float, default=2.0)
    parser.add_argument("--slow-factor", type=float, default=10.0)
    parser.add_argument("--fragment-length", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-s", type=float, default=1.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    delays = [args.fast_ms / 1e3] * (args.processes - 1) + [args.fast_ms * args.slow_factor / 1e3]
    factories = [functools.partial(SleepyCartPole, args.num_envs, d) for d in delays]
    torch.manual_seed(0)
    pools = {name: EnvWorkerPool(factories) for name in ("lock_step", "polling")}
    tree = pools["lock_step"].tree
    policies, assignment = make_policies(tree), assign(tree)
    actors = {"lock_step": Actor(pools["lock_step"], policies, assignment, fragment_length=args.fragment_length),
              "polling": PollingActor(pools["polling"], policies, assignment, fragment_length=args.fragment_length)}
    try:
        for actor in actors.values():
            run_for(actor, 0.3)  # warm-up: first forwards, layouts, allocator
        polled_before = actors["polling"].process_steps
        rates: dict[str, list[float]] = {name: [] for name in actors}
        for _ in range(args.rounds):
            for name, actor in actors.items():
                rates[name].append(run_for(actor, args.round_s))
        polled = [a - b for a, b in zip(actors["polling"].process_steps, polled_before)]
    finally:
        for pool in pools.values():
            pool.close()
    medians = {name: statistics.median(v) for name, v in rates.items()}
    n, k = args.num_envs, args.processes
    slow_s, fast_s = delays[-1], delays[0]
    print(json.dumps({
        "benchmark": "env_polling", "processes": k, "envs_per_process": n, "fast_step_ms": args.fast_ms,
        "slow_step_ms": args.fast_ms * args.slow_factor, "fragment_length": args.fragment_length,
        "rounds": args.rounds, "round_s": args.round_s,
        "env_steps_per_s": {name: round(v) for name, v in medians.items()},
        "ratio_polling_vs_lock_step": round(medians["polling"] / medians["lock_step"], 2),
        # sleeps alone (no IPC, no inference): what each setup could reach at most
        "sleep_bound_env_steps_per_s": {"lock_step": round(k * n / slow_s),
                                        "polling": round((k - 1) * n / fast_s + n / slow_s)},
        "polling_steps_per_process": polled,
        "runs": {name: [round(r) for r in v] for name, v in rates.items()}}, indent=1))


if __name__ == "__main__":
    main()
