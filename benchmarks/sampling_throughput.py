"""End-to-end sampling throughput of an Actor against the ceiling measured in the same run.

Ceiling: the raw environment stepped in a tight loop with one batched forward of the same 64x64 policy
network per step (tensors only, Gumbel-max sampling, no recording; no critic: Shoal's actors do not run
one either, the learner evaluates values for the whole batch). Ours: ``Actor.collect()`` (policy act,
adapter, fragment assembly with episode bookkeeping, log-probabilities). Target: ours / ceiling >= 0.8.

Both sides are built once per case and warmed up with one round. A timed round is one fragment of ``steps``
steps on our side, and as many ceiling steps, interleaved in chunks of ``steps / 8`` (ceiling chunk, our
chunk, ...; the fragment is assembled in our last chunk), so that slow phases of a shared machine hit both
alike; the figure is the median over rounds of the ratio within a round. Steady state on both sides: a
fresh sampler per round would also time first-use costs (allocator growth, a cold policy), which the
ceiling's loop barely has and a run amortises.

    python benchmarks/sampling_throughput.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from core.policies import make_policies
from orchestration.actor import Actor
from orchestration.assignment import assign
from orchestration.envs import make_env

#: A sampler: ``run(steps)`` steps every env ``steps`` times; returns ``(env steps, seconds)``.
Sampler = Callable[[int], tuple[int, float]]
#: Chunks per timed round: ceiling and ours alternate every ``steps / CHUNKS`` steps.
CHUNKS = 8


def _mlp(n_in: int, n_out: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The 64x64 policy network as its layers' ``forward`` calls: no ``Module.__call__`` hook dispatch (~2 µs per
    layer), as Shoal's own acting path runs it, so the ceiling stays the tightest loop."""
    layers = [torch.nn.Linear(n_in, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
              torch.nn.Linear(64, n_out)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer.forward(x)
        return x

    return forward


def _gumbel(logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The leanest Gumbel-max draw (exponential noise, no clamp): a tight reference."""
    return (logits - torch.empty_like(logits).exponential_(generator=g).log_()).argmax(-1)


def ceiling_gym_vector(num_envs: int) -> Sampler:
    """Raw gymnasium SyncVectorEnv + one batched MLP forward + sampling per step.

    Counts real transitions only: in gymnasium's default NEXT_STEP mode a sub-env that finished spends its
    next ``step`` call on a reset (its action ignored), which is not an env step (Shoal's adapter resets in
    the same step and never produces that dummy transition).
    """
    import gymnasium as gym

    env = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * num_envs)
    actor, g = _mlp(4, 2), torch.Generator().manual_seed(0)
    state = {"obs": env.reset(seed=0)[0], "ended": (np.zeros(num_envs, dtype=bool),) * 2}

    def run(steps: int) -> tuple[int, float]:
        obs, ended = state["obs"], [state["ended"]]
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                a = _gumbel(actor(torch.from_numpy(obs)), g)
                obs, _, term, trunc, _ = env.step(a.numpy())
                ended.append((term, trunc))
        elapsed = time.perf_counter() - start
        state["obs"], state["ended"] = obs, ended[-1]
        dummy = sum(int((t | u).sum()) for t, u in ended[:-1])  # sub-envs that spent a call on their reset
        return steps * num_envs - dummy, elapsed

    return run


def ceiling_builtin_cartpole(num_envs: int) -> Sampler:
    """The built-in torch CartPole env's own step + one batched MLP forward per step (tensors only)."""
    from adapters.assembly import make_td
    from adapters.builtin.cartpole import CartPole, CartPoleConfig

    env = CartPole(CartPoleConfig(num_envs=num_envs))
    g = torch.Generator().manual_seed(0)
    actor = _mlp(4, 2)
    state = {"out": env.reset(seed=0)}
    env_batch, agent_batch = torch.Size([num_envs]), torch.Size([num_envs, 1])

    def run(steps: int) -> tuple[int, float]:
        out = state["out"]
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                x = out.get(("agent", "observation"))
                a = _gumbel(actor(x), g)
                # the cheapest TensorDict construction (no per-key checks), as Shoal's actor builds its actions
                out = env.step(make_td({"agent": make_td({"action": a}, agent_batch)}, env_batch))
        elapsed = time.perf_counter() - start
        state["out"] = out
        return steps * num_envs, elapsed

    return run


def ceiling_mpe2(num_copies: int) -> Sampler:
    """Raw mpe2 simple_spread parallel envs + one batched MLP forward over all agents per step."""
    from mpe2 import simple_spread_v3

    envs = [simple_spread_v3.parallel_env(max_cycles=25) for _ in range(num_copies)]
    obs = [e.reset(seed=i)[0] for i, e in enumerate(envs)]
    agents = envs[0].possible_agents
    actor, g = _mlp(18, 5), torch.Generator().manual_seed(0)

    def run(steps: int) -> tuple[int, float]:
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
        return steps * num_copies, time.perf_counter() - start

    return run


def ours(env_name: str, num_envs: int, fragment_length: int) -> Sampler:
    """``Actor.collect()``, in pieces: ``run(k)`` takes ``k`` actor steps and assembles the fragment when it is
    full (policy act + adapter + fragment assembly; what ``collect()`` runs)."""
    env = make_env(env_name, num_envs, shared_state=False)  # a local critic: state() is not read
    actor = Actor(env, make_policies(env.tree), assign(env.tree), fragment_length=fragment_length, seed=0)
    state = {"steps": 0}

    def run(steps: int) -> tuple[int, float]:
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                actor.step()
            state["steps"] += steps
            if state["steps"] == fragment_length:
                actor.build_fragment()
                state["steps"] = 0
        return steps * num_envs, time.perf_counter() - start

    return run


CASES = {
    "gymnasium_sync_vector_cartpole_64": ("CartPole-v1", 64, ceiling_gym_vector),
    "builtin_torch_cartpole_1024": ("builtin:cartpole", 1024, ceiling_builtin_cartpole),
    "mpe2_simple_spread_8_copies": ("mpe2:simple_spread_v3", 8, ceiling_mpe2),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run with few steps and one round")
    parser.add_argument("--rounds", type=int, default=15,
                        help="interleaved timed rounds (ratios of single rounds swing by +-15%% on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps, rounds = (16, 1) if args.quick else (256, args.rounds)
    assert steps % CHUNKS == 0
    results = {}
    for name, (env_name, n, ceiling_fn) in CASES.items():
        ceiling, sampler = ceiling_fn(n), ours(env_name, n, steps)
        ceiling(steps), sampler(steps)  # warm-up round: first-use costs on both sides
        chunk = steps // CHUNKS
        c, o = [], []
        for _ in range(rounds):
            totals = np.zeros((2, 2))  # [ceiling, ours] x [env steps, seconds]
            for _ in range(CHUNKS):
                totals[0] += ceiling(chunk)
                totals[1] += sampler(chunk)
            c.append(totals[0, 0] / totals[0, 1])
            o.append(totals[1, 0] / totals[1, 1])
        ratios = [a / b for a, b in zip(o, c)]
        results[name] = {"env_steps_per_s": round(statistics.median(o)),
                         "ceiling_env_steps_per_s": round(statistics.median(c)),
                         "ratio": round(statistics.median(ratios), 3),
                         "ratio_of_medians": round(statistics.median(o) / statistics.median(c), 3),
                         "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)], "target": 0.8}
    print(json.dumps({"benchmark": "sampling_throughput", "steps_per_fragment": steps, "rounds": rounds,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
