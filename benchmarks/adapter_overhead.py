"""Env-steps/s through Shoal's adapters vs the raw envs, with the same pre-drawn random actions.

Cases (each prints raw and adapter env-steps/s, medians over interleaved repeats, and their ratio):

- ``gym_cartpole_sync64``: ``SyncVectorEnv`` of 64 ``CartPole-v1``. Raw: gymnasium's default NEXT_STEP loop
  (``raw``; its dummy reset calls are not counted as env steps) and a SAME_STEP loop (``raw_same_step``).
  Adapter: ``make_gymnasium("CartPole-v1", 64)`` (NEXT_STEP, finished sub-envs reset in the same step).
- ``mpe2_simple_spread_x1`` / ``_x8``: raw ``parallel_env`` loops (dict actions, reset when ``agents`` is empty)
  over 1 and 8 instances vs ``PettingZooParallelEnv`` with 1 and 8 copies as a run builds it
  (``adapter``: no ``state()``, which only a central critic reads) and with the shared ``state()``
  observation (``adapter_with_state``: one extra env call per copy and step that the raw loop does not make).

``overhead`` gives the adapter's own CPU µs per step (CPU time of the run minus CPU time inside env calls),
measured on a separately built, instrumented adapter: a figure that noise on a shared machine moves less
than a ratio of two timed runs.

Usage: ``python benchmarks/adapter_overhead.py [--repeats 7] [--quick]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from functools import partial

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from mpe2 import simple_spread_v3
from tensordict import TensorDict

from adapters.gymnasium_env import make_gymnasium
from adapters.pettingzoo_env import PettingZooParallelEnv


def timed(fn) -> tuple[float, float, int | None]:
    """(wall seconds, CPU seconds of this process, what ``fn`` returned) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


class EnvClock:
    """Adds up the CPU time spent inside the named methods of some objects (the env calls of an adapter).

    ``objects``: ``(object, method names)`` pairs; no timed method may call another (it would count twice).
    """

    def __init__(self, objects) -> None:
        self.cpu = 0.0
        for obj, names in objects:
            for name in names:
                if hasattr(obj, name):
                    setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, fn):
        def timed_call(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - start
        return timed_call


def overhead(make_adapter, env_objects, tds, repeats: int = 3) -> dict:
    """CPU µs per step spent in the adapter itself (outside env calls), from a separately built adapter."""
    adapter = make_adapter()
    clock = EnvClock(env_objects(adapter))
    own, env = [], []

    def run():
        adapter.reset(seed=0)
        for td in tds:
            adapter.step(td)

    for _ in range(repeats):
        clock.cpu = 0.0
        _, cpu, _ = timed(run)
        own.append((cpu - clock.cpu) / len(tds) * 1e6)
        env.append(clock.cpu / len(tds) * 1e6)
    adapter.close()
    return {"adapter_own_cpu_us_per_step": round(statistics.median(own)),
            "env_cpu_us_per_step_inside_adapter": round(statistics.median(env))}


def gym_case(steps: int, num_envs: int = 64) -> dict:
    acts = np.random.default_rng(0).integers(0, 2, (steps, num_envs))
    tds = [TensorDict({"agent": TensorDict({"action": torch.from_numpy(a).reshape(num_envs, 1)},
                                           batch_size=(num_envs, 1))}, batch_size=(num_envs,)) for a in acts]
    fns = [partial(gym.make, "CartPole-v1")] * num_envs
    raw = SyncVectorEnv(fns)  # gymnasium's default: NEXT_STEP
    raw_same = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    adapter = make_gymnasium("CartPole-v1", num_envs)

    def loop(env):
        def go() -> int:
            """Real transitions: in NEXT_STEP mode a sub-env that finished spends its next call resetting
            (its action ignored), which is no env step (the adapter never makes that dummy step)."""
            env.reset(seed=0)
            flags = [env.step(a)[2:4] for a in acts]
            dummy = sum(int((t | u).sum()) for t, u in flags[:-1]) if env.autoreset_mode.name == "NEXT_STEP" else 0
            return len(acts) * num_envs - dummy
        return go

    def run_adapter():
        adapter.reset(seed=0)
        for td in tds:
            adapter.step(td)

    return {"variants": {"raw": loop(raw), "raw_same_step": loop(raw_same), "adapter": run_adapter},
            "env_steps": steps * num_envs, "close": [raw.close, raw_same.close, adapter.close],
            "overhead": lambda: overhead(lambda: make_gymnasium("CartPole-v1", num_envs), gym_env_calls, tds)}


def gym_env_calls(adapter) -> list:
    """The vector env's step and the sub-env resets the adapter issues itself (its fast path)."""
    return [(adapter.env, ("step",)), *((sub, ("reset",)) for sub in adapter.env.envs)]


def mpe_case(steps: int, copies: int) -> dict:
    make = simple_spread_v3.parallel_env
    acts = np.random.default_rng(1).integers(0, 5, (steps, copies, 3))
    tds = [TensorDict({"agent": TensorDict({"action": torch.from_numpy(a)}, batch_size=(copies, 3))},
                      batch_size=(copies,)) for a in acts]
    raws = [make() for _ in range(copies)]
    adapter = PettingZooParallelEnv(make, copies, state=False)
    with_state = PettingZooParallelEnv(make, copies)

    def run_raw():
        for e, env in enumerate(raws):
            env.reset(seed=e)
        for a in acts:
            for e, env in enumerate(raws):
                env.step({agent: a[e, i] for i, agent in enumerate(env.agents)})
                if not env.agents:
                    env.reset()

    def run(env):
        def go():
            env.reset(seed=0)
            for td in tds:
                env.step(td)
        return go

    return {"variants": {"raw": run_raw, "adapter": run(adapter), "adapter_with_state": run(with_state)},
            "env_steps": steps * copies, "close": [*(r.close for r in raws), adapter.close, with_state.close],
            "overhead": lambda: overhead(lambda: PettingZooParallelEnv(make, copies, state=False),
                                         lambda a: [(e, ("step", "reset", "state")) for e in a.envs], tds)}


def measure(case: dict, repeats: int) -> dict:
    """Median env-steps/s per variant and the median of per-repeat ratios to each raw variant.

    Variants run back to back in a rotating order within each repeat, and each ratio compares runs of the
    same repeat, so slow phases of a shared machine hit both sides of a ratio alike. Rates are given by wall
    clock and by this process's CPU time (everything here is single-threaded and in-process; CPU time does
    not count the time other jobs on a shared machine take the core away).
    """
    names = list(case["variants"])
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            w, c, steps = timed(case["variants"][name])
            steps = case["env_steps"] if steps is None else steps
            wall[name].append(steps / w)
            cpu[name].append(steps / max(c, 1e-9))
    for close in case["close"]:
        close()
    out: dict = {}
    for clock, rates in (("wall", wall), ("cpu", cpu)):
        out[clock] = {f"{name}_env_steps_per_s": round(statistics.median(r)) for name, r in rates.items()}
        for name in (n for n in names if n.startswith("adapter")):
            for base in (n for n in names if n.startswith("raw")):
                paired = [a / b for a, b in zip(rates[name], rates[base])]
                out[clock][f"{name}_vs_{base}"] = round(statistics.median(paired), 3)
    out["wall"]["raw_spread"] = [round(min(wall["raw"])), round(max(wall["raw"]))]
    out["overhead"] = case["overhead"]()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="short segments (smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = 0.1 if args.quick else 1.0
    results = {
        "gym_cartpole_sync64": measure(gym_case(int(300 * scale)), args.repeats),
        "mpe2_simple_spread_x1": measure(mpe_case(int(600 * scale), 1), args.repeats),
        "mpe2_simple_spread_x8": measure(mpe_case(int(100 * scale), 8), args.repeats),
    }
    print(json.dumps({"benchmark": "adapter_overhead", "python": platform.python_version(),
                      "torch": torch.__version__, "gymnasium": gym.__version__, "torch_threads": 1,
                      "repeats": args.repeats,
                      "statistic": "median env-steps/s (wall clock, and CPU time of the process); "
                                   "X_vs_Y = median over repeats of (X / Y) within a repeat",
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
