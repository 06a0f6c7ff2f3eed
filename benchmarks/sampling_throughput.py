"""End-to-end sampling throughput of an Actor against the ceiling measured in the same run.

Ceiling: the raw environment stepped in a tight loop with one batched forward of the same 64x64 policy
network per step (tensors only, Gumbel-max sampling, no recording; no critic: Shoal's actors do not run
one either, the learner evaluates values for the whole batch). Ours: ``Actor.collect()`` (policy act,
adapter, fragment assembly with episode bookkeeping). Target: ours / ceiling >= 0.8, as the median over
interleaved repeats of the ratio within a repeat.

    python benchmarks/sampling_throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from core.policies import make_policies
from orchestration.actor import Actor
from orchestration.assignment import assign
from orchestration.envs import make_env


def _mlp(n_in: int, n_out: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(n_in, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, n_out))


def _gumbel(logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The leanest Gumbel-max draw (exponential noise, no clamp): a tight reference."""
    return (logits - torch.empty_like(logits).exponential_(generator=g).log_()).argmax(-1)


def ceiling_gym_vector(num_envs: int, steps: int) -> float:
    """Raw gymnasium SyncVectorEnv + one batched MLP forward + sampling per step.

    Counts real transitions only: in gymnasium's default NEXT_STEP mode a sub-env that finished spends its
    next ``step`` call on a reset (its action ignored), which is not an env step (Shoal's adapter resets in
    the same step and never produces that dummy transition).
    """
    import gymnasium as gym

    env = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * num_envs)
    actor, g = _mlp(4, 2), torch.Generator().manual_seed(0)
    obs, _ = env.reset(seed=0)
    flags = []
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            x = torch.from_numpy(obs)
            a = _gumbel(actor(x), g)
            obs, _, term, trunc, _ = env.step(a.numpy())
            flags.append((term, trunc))
    elapsed = time.perf_counter() - start
    env.close()
    dummy = sum(int((t | u).sum()) for t, u in flags[:-1])  # each finished sub-env spends the next call resetting
    return (steps * num_envs - dummy) / elapsed


def ceiling_builtin_cartpole(num_envs: int, steps: int) -> float:
    """The built-in torch CartPole env's own step + one batched MLP forward per step (tensors only)."""
    from tensordict import TensorDict

    from adapters.builtin.cartpole import CartPole, CartPoleConfig

    env = CartPole(CartPoleConfig(num_envs=num_envs))
    g = torch.Generator().manual_seed(0)
    actor = _mlp(4, 2)
    out = env.reset(seed=0)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            x = out.get(("agent", "observation"))
            a = _gumbel(actor(x), g)
            out = env.step(TensorDict({"agent": TensorDict({"action": a}, [num_envs, 1])}, [num_envs]))
    return steps * num_envs / (time.perf_counter() - start)


def ceiling_mpe2(num_copies: int, steps: int) -> float:
    """Raw mpe2 simple_spread parallel envs + one batched MLP forward over all agents per step."""
    from mpe2 import simple_spread_v3

    envs = [simple_spread_v3.parallel_env(max_cycles=25) for _ in range(num_copies)]
    obs = [e.reset(seed=i)[0] for i, e in enumerate(envs)]
    agents = envs[0].possible_agents
    actor, g = _mlp(18, 5), torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            x = torch.from_numpy(np.stack([np.stack([o[a] for a in agents]) for o in obs]))
            acts = _gumbel(actor(x), g).numpy()
            for i, e in enumerate(envs):
                o, _, term, trunc, _ = e.step({a: int(acts[i, j]) for j, a in enumerate(agents)})
                if all(term.values()) or all(trunc.values()):
                    o, _ = e.reset()
                obs[i] = o
    return steps * num_copies / (time.perf_counter() - start)


def ours(env_name: str, num_envs: int, steps: int) -> float:
    """Actor.collect() of fragments (policy act + adapter + fragment assembly)."""
    env = make_env(env_name, num_envs, shared_state=False)  # a local critic: state() is not read
    policies = make_policies(env.tree)
    actor = Actor(env, policies, assign(env.tree), fragment_length=steps, seed=0)
    actor.collect()  # warm-up fragment: first-step layout capture, allocator
    start = time.perf_counter()
    actor.collect()
    elapsed = time.perf_counter() - start
    env.close() if hasattr(env, "close") else None
    return steps * num_envs / elapsed


CASES = {
    "gymnasium_sync_vector_cartpole_64": ("CartPole-v1", 64, ceiling_gym_vector),
    "builtin_torch_cartpole_1024": ("builtin:cartpole", 1024, ceiling_builtin_cartpole),
    "mpe2_simple_spread_8_copies": ("mpe2:simple_spread_v3", 8, ceiling_mpe2),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run with few steps and one repeat")
    parser.add_argument("--repeats", type=int, default=9,
                        help="interleaved repeats (ratios of single repeats swing by +-20%% on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps, repeats = (16, 1) if args.quick else (256, args.repeats)
    results = {}
    for name, (env_name, n, ceiling_fn) in CASES.items():
        c, o = [], []
        for _ in range(repeats):  # interleaved, so slow phases of the machine hit both alike
            c.append(ceiling_fn(n, steps))
            o.append(ours(env_name, n, steps))
        results[name] = {"env_steps_per_s": round(statistics.median(o)),
                         "ceiling_env_steps_per_s": round(statistics.median(c)),
                         "ratio": round(statistics.median(a / b for a, b in zip(o, c)), 3),
                         "ratio_range": [round(min(a / b for a, b in zip(o, c)), 3),
                                         round(max(a / b for a, b in zip(o, c)), 3)], "target": 0.8}
    print(json.dumps({"benchmark": "sampling_throughput", "steps_per_fragment": steps, "repeats": repeats,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
