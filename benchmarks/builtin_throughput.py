"""Throughput of the built-in torch envs, printed as one JSON object.

Measures, with random actions drawn inside the timed loop (1 torch thread unless ``--threads``):

- ``cartpole``: :class:`adapters.builtin.CartPole` through the protocol (TensorDicts in and out) at several
  batch sizes, next to ``cartpole_raw``: the same dynamics, partial resets and step counters on bare tensors
  (the limit our protocol wrapping is measured against), in the same run;
- ``gymnasium_cartpole_vector``: gymnasium's numpy ``CartPoleVectorEnv`` at the same batch sizes (the anchor
  of ``notes/anchor-measurements.md`` §1, re-measured here because this machine's speed drifts);
- ``spread``: :class:`adapters.builtin.Spread` (capacity 4) env-steps/s and agent-steps/s (present agents).

Each figure is the median of ``--repeats`` interleaved runs; every run is listed. ``cartpole_vs_raw``: the median
of the ratios within a repeat (each batch size's cases run back to back). Targets (issue 18): >= 0.85 of raw at
every batch size, and at least gymnasium's rate at the largest. ``*_cpu`` figures divide by
the process CPU time instead of the wall clock: steadier when other jobs share the machine.

Run: ``python benchmarks/builtin_throughput.py [--repeats 3] [--seconds 1.0] [--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from tensordict import TensorDict

from adapters.builtin import CartPole, CartPoleConfig, Spread, SpreadConfig
from adapters.builtin.cartpole import cartpole_dynamics, initial_states
from core.layout import ACTION, MASK, NEXT
from core.tensordicts import make_td


def _timed(step, seconds: float) -> tuple[float, float, int]:
    """Runs ``step`` (returns items done) for about ``seconds``: (items/s wall, items/s CPU, steps)."""
    for _ in range(5):
        step()
    items = steps = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        items += step()
        steps += 1
    wall, cpu = time.perf_counter() - wall, max(time.process_time() - cpu, 1e-9)
    return items / wall, items / cpu, steps


def cartpole_env(n: int):
    env, generator = CartPole(CartPoleConfig(num_envs=n)), torch.Generator().manual_seed(0)
    env.reset(seed=0)
    env_batch, group_batch = torch.Size([n]), torch.Size([n, 1])

    def step() -> int:
        # actions built as Shoal's actor builds them (unchecked TensorDicts: the step's input is part of the
        # protocol's cost, a checked TensorDict.set is not)
        action = torch.randint(0, 2, (n, 1), generator=generator)
        env.step(make_td({"agent": make_td({ACTION: action}, group_batch)}, env_batch))
        return n
    return step


def cartpole_raw(n: int):
    generator = torch.Generator().manual_seed(0)
    box = {"state": initial_states(n, generator, torch.float32, "cpu"), "steps": torch.zeros(n, dtype=torch.int64)}

    def step() -> int:
        state, terminated = cartpole_dynamics(box["state"], torch.randint(0, 2, (n,), generator=generator))
        steps = box["steps"] + 1
        ended = (terminated | (steps >= 500)).nonzero().squeeze(1)
        state.index_copy_(1, ended, initial_states(ended.numel(), generator, torch.float32, "cpu"))
        box["state"], box["steps"] = state, steps.index_fill_(0, ended, 0)
        return n
    return step


def gymnasium_vector(n: int):
    import gymnasium

    env = gymnasium.make_vec("CartPole-v1", num_envs=n, vectorization_mode="vector_entry_point")
    env.reset(seed=0)
    rng = np.random.default_rng(0)

    def step() -> int:
        env.step(rng.integers(0, 2, size=n))
        return n
    return step


def spread_env(n: int, agent_steps: list):
    env, generator = Spread(SpreadConfig(num_envs=n)), torch.Generator().manual_seed(0)
    box = {"root": env.reset(seed=0)}

    def step() -> int:
        action = torch.randint(0, 5, (n, 4), generator=generator)
        out = env.step(TensorDict({"agents": TensorDict({ACTION: action}, batch_size=[n, 4])}, batch_size=[n]))
        agent_steps.append(int(out.get((NEXT, "agents", MASK)).sum()))
        box["root"] = out
        return n
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs: dict[str, list] = {}
    spread_agents: list[int] = []
    # each batch size's three cases side by side: the protocol and its raw dynamics seconds apart, not a whole
    # sweep apart (the machine's speed drifts over a sweep)
    cases = {f"{kind}/{n}": (make, n) for n in args.batches
             for kind, make in (("cartpole", cartpole_env), ("cartpole_raw", cartpole_raw),
                                ("gymnasium_cartpole_vector", gymnasium_vector))}
    cases["spread/1024"] = (lambda n: spread_env(n, spread_agents), 1024)
    for _ in range(args.repeats):  # interleaved, so slow phases of the machine hit every case alike
        for name, (make, n) in cases.items():
            runs.setdefault(name, []).append(_timed(make(n), args.seconds))
    result: dict = {"torch_threads": args.threads, "torch": torch.__version__, "repeats": args.repeats,
                    "unit": "env-steps/s"}
    for name, values in runs.items():
        kind, n = name.split("/")
        entry = result.setdefault(kind, {})
        entry[n] = round(statistics.median(v[0] for v in values))
        entry[f"{n}_cpu"] = round(statistics.median(v[1] for v in values))
        entry[f"{n}_runs"] = [round(v[0]) for v in values]
    result["spread"]["agents_present_per_env"] = round(sum(spread_agents) / max(len(spread_agents), 1) / 1024, 2)
    result["spread"]["1024_agent_steps"] = round(result["spread"]["1024"] * result["spread"]["agents_present_per_env"])
    ratios = {n: [a[0] / b[0] for a, b in zip(runs[f"cartpole/{n}"], runs[f"cartpole_raw/{n}"])] for n in args.batches}
    result["cartpole_vs_raw"] = {n: round(statistics.median(r), 2) for n, r in ratios.items()}  # within a repeat
    result["cartpole_vs_raw_runs"] = {n: [round(x, 3) for x in r] for n, r in ratios.items()}
    result["targets"] = {"cartpole_vs_raw_min": 0.85, "meets": {
        "vs_raw": all(v >= 0.85 for v in result["cartpole_vs_raw"].values()),
        "vs_gymnasium_at_largest": result["cartpole"][str(max(args.batches))]
        >= result["gymnasium_cartpole_vector"][str(max(args.batches))]}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
