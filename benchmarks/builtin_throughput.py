"""Throughput of the built-in torch envs, printed as one JSON object.

Measures, with random actions drawn inside the timed loop (1 torch thread unless ``--threads``):

- ``cartpole``: :class:`adapters.builtin.CartPole` through the protocol (TensorDicts in and out) at several
  batch sizes, next to ``cartpole_raw``: the same dynamics, partial resets and step counters on bare tensors
  (the limit our protocol wrapping is measured against), in the same run;
- ``gymnasium_cartpole_vector``: gymnasium's numpy ``CartPoleVectorEnv`` at the same batch sizes (the anchor
  of ``notes/anchor-measurements.md`` §1, re-measured here because this machine's speed drifts);
- ``spread``: :class:`adapters.builtin.Spread` (capacity 4) env-steps/s and agent-steps/s (present agents).

Each figure is the median of ``--repeats`` interleaved runs; every run is listed. ``*_cpu`` figures divide by
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
    cases = {**{f"cartpole/{n}": (cartpole_env, n) for n in args.batches},
             **{f"cartpole_raw/{n}": (cartpole_raw, n) for n in args.batches},
             **{f"gymnasium_cartpole_vector/{n}": (gymnasium_vector, n) for n in args.batches},
             "spread/1024": (lambda n: spread_env(n, spread_agents), 1024)}
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
    result["cartpole_vs_raw"] = {n: round(result["cartpole"][str(n)] / result["cartpole_raw"][str(n)], 2)
                                 for n in args.batches}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
