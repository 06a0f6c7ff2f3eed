"""A minimal hand-written PPO for gymnasium CartPole-v1: the reference of ``cartpole_time_to_450.py``.

CleanRL ``ppo.py`` style (https://github.com/vwxyzjn/cleanrl/blob/master/cleanrl/ppo.py), pure torch on raw
tensors: ``SyncVectorEnv`` of ``gymnasium.make`` envs, separate 64x64 tanh actor and critic with orthogonal init
(gain sqrt(2) hidden, 0.01 policy output, 1.0 value output, zero biases), GAE, clipped surrogate, per-minibatch
advantage normalisation, 0.5 * value MSE, global grad-norm clip, Adam (eps 1e-5), linear lr annealing.

Departures from CleanRL, each to match Shoal's semantics (so the two measure the same thing):

- Autoreset ``SAME_STEP``: a finished env's final observation comes from ``info["final_obs"]``; truncation
  (the 500-step time limit) is bootstrapped with ``V(final observation)``, termination is not (CleanRL treats
  both as terminal). The critic runs once per iteration on every "true" next observation ``[T, E]``.
- A fragment end is bootstrapped with ``V(next observation)`` (as CleanRL).
- Finished episodes are counted per iteration in env-then-time order (Shoal's ``FragmentBuilder`` scan order),
  then appended to a 100-long deque; the criterion is the mean of its last ``window`` entries, checked after
  each iteration (Shoal's ``Trainer`` reports per iteration).
- Randomness is laid out as Shoal lays it out, so that one seed gives both the same run (see
  ``cartpole_time_to_450.py``, "paired runs"): actions are drawn by Gumbel-max (``argmax(logits - log E)``,
  ``E ~ Exp(1)``: a ``Categorical`` draw) from a generator seeded with ``seed`` (Shoal's actor), minibatch
  permutations come from a second generator seeded with ``seed`` (Shoal's learner), and minibatches index the
  rollout env-major (Shoal's flattened ``[E, T]`` batch).
- Past the annealing horizon the learning rate stays 0 (Shoal's formula would go negative there).

    from benchmarks.handwritten_ppo import DEFAULT_HPARAMS, run
    run(DEFAULT_HPARAMS, seed=1, stop_return=450, max_steps=300_000, window=10)
    # {"time_s": ..., "env_steps": ..., "reached": True, ...}
"""

from __future__ import annotations

import math
import time
from collections import deque
from functools import partial
from typing import Any, Mapping

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv

DEFAULT_HPARAMS: dict[str, Any] = {
    "env_id": "CartPole-v1",
    "num_envs": 16,  # RolloutConfig.num_envs
    "fragment_length": 64,  # RolloutConfig.fragment_length (steps per env per iteration)
    "lr": 2.5e-3,  # TrainConfig.lr of the cartpole preset (orchestration/presets/cartpole.yaml)
    "anneal_lr": True,  # TrainConfig.anneal_lr
    "iterations": 100,  # TrainConfig.iterations: the annealing horizon
    "num_epochs": 4,
    "minibatch_size": 256,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "clip_eps": 0.2,
    "value_coef": 0.5,
    "entropy_coef": 0.0,
    "max_grad_norm": 0.5,
    "advantage_eps": 1e-8,
    "hidden_sizes": (64, 64),
    "hidden_gain": math.sqrt(2.0),
    "actor_output_gain": 0.01,
    "critic_output_gain": 1.0,
}


def _mlp(sizes: list[int], hidden_gain: float, out_gain: float) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = torch.nn.Linear(a, b)
        last = i == len(sizes) - 2
        torch.nn.init.orthogonal_(lin.weight, out_gain if last else hidden_gain)
        torch.nn.init.zeros_(lin.bias)
        layers.append(lin)
        if not last:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def hparams_from_config(cfg: Any) -> dict[str, Any]:
    """The hyper-parameters of :func:`run` read from a Shoal ``TrainConfig`` (attribute access only, so this file
    imports nothing of Shoal's); refuses settings the hand-written PPO does not implement."""
    pol, ppo, rc = cfg.policy, cfg.ppo, cfg.rollout
    unsupported = {"activation": pol.activation != "tanh", "recurrent": pol.recurrent,
                   "agent_id_input": pol.agent_id_input, "value_clip_eps": ppo.value_clip_eps is not None,
                   "target_kl": ppo.target_kl is not None, "normalize_advantage": not ppo.normalize_advantage,
                   "num_workers": rc.num_workers != 1, "train_batch_size": cfg.steps_per_iteration !=
                   rc.num_envs * rc.fragment_length, "max_grad_norm": ppo.max_grad_norm is None}
    if bad := [k for k, v in unsupported.items() if v]:
        raise ValueError(f"the hand-written PPO does not implement these settings: {bad}")
    return {
        "env_id": cfg.env, "num_envs": rc.num_envs, "fragment_length": rc.fragment_length, "lr": cfg.lr,
        "anneal_lr": cfg.anneal_lr, "iterations": cfg.iterations, "num_epochs": ppo.num_epochs,
        "minibatch_size": ppo.minibatch_size, "gamma": ppo.gamma, "gae_lambda": ppo.gae_lambda,
        "clip_eps": ppo.clip_eps, "value_coef": ppo.value_coef, "entropy_coef": ppo.entropy_coef,
        "max_grad_norm": ppo.max_grad_norm, "advantage_eps": ppo.advantage_eps, "hidden_sizes": pol.hidden_sizes,
        "hidden_gain": pol.hidden_gain, "actor_output_gain": pol.actor_output_gain,
        "critic_output_gain": pol.critic_output_gain,
    }


def run(hparams: Mapping[str, Any] = DEFAULT_HPARAMS, seed: int = 0, stop_return: float = 450.0,
        max_steps: int = 300_000, window: int = 10, deadline_s: float | None = None,
        return_modules: bool = False) -> dict[str, Any]:
    """Trains until the mean return of the last ``window`` finished episodes reaches ``stop_return``.

    The clock starts before the envs and networks are built (the caller imports beforehand).

    Args:
        hparams: see :data:`DEFAULT_HPARAMS` (missing keys take the defaults).
        seed: seeds the initial weights, env resets (env ``i``: ``seed + i``), sampling and minibatch order.
        stop_return: the target mean return.
        max_steps: env-step cap; the run stops after the iteration that reaches it.
        window: how many of the most recent finished episodes the criterion averages (10 or 100); the
            criterion needs at least ``window`` finished episodes.
        deadline_s: wall-clock cap in seconds (None: none).
        return_modules: add the trained ``"actor"`` and ``"critic"`` modules to the result.

    Returns:
        ``time_s`` (to the end of the iteration meeting the criterion, or of the last one), ``cpu_s`` (this
        process's CPU time over the same span: less sensitive to other load on a shared machine), ``env_steps``,
        ``reached``, ``iterations``, ``episodes`` (finished), ``return_mean_10``, ``return_mean_100`` (at the end),
        ``time_sample_s``, ``time_update_s`` (rollout + GAE, SGD), and ``first``: ``{"10": {...}, "100": {...}}``,
        the ``time_s``/``cpu_s``/``env_steps``/``iteration`` at which the last-10 and last-100 means first reached
        ``stop_return`` (a window absent there never did).
    """
    if not 1 <= window <= 100:
        raise ValueError(f"window must be in [1, 100] (the episode deque holds 100), got {window}")
    hp = {**DEFAULT_HPARAMS, **hparams}
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)  # initial weights (a script's entry point, as Shoal's build_trainer does)
    sample_gen = torch.Generator().manual_seed(seed)  # action noise
    perm_gen = torch.Generator().manual_seed(seed)  # minibatch order
    n_env, n_t = hp["num_envs"], hp["fragment_length"]
    envs = SyncVectorEnv([partial(gym.make, hp["env_id"])] * n_env, autoreset_mode=AutoresetMode.SAME_STEP)
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    n_act = int(envs.single_action_space.n)
    hidden = list(hp["hidden_sizes"])
    actor = _mlp([obs_dim, *hidden, n_act], hp["hidden_gain"], hp["actor_output_gain"])
    critic = _mlp([obs_dim, *hidden, 1], hp["hidden_gain"], hp["critic_output_gain"])
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = torch.optim.Adam(params, lr=hp["lr"], eps=1e-5, fused=True)

    b_obs = torch.zeros(n_t, n_env, obs_dim)
    b_next_obs = torch.zeros(n_t, n_env, obs_dim)  # true next observation (final one where done)
    b_act = torch.zeros(n_t, n_env, dtype=torch.long)
    b_logp = torch.zeros(n_t, n_env)
    b_val = torch.zeros(n_t, n_env)
    b_rew = torch.zeros(n_t, n_env)
    b_term = torch.zeros(n_t, n_env)
    b_done = torch.zeros(n_t, n_env)

    obs_np, _ = envs.reset(seed=[seed + i for i in range(n_env)])
    obs = torch.as_tensor(obs_np, dtype=torch.float32).reshape(n_env, obs_dim)
    running = np.zeros(n_env)
    returns: deque[float] = deque(maxlen=100)
    env_steps = iteration = 0
    t_sample = t_update = 0.0
    reached = False
    first: dict[int, dict[str, float]] = {}
    episodes = 0
    gamma, lam = hp["gamma"], hp["gae_lambda"]
    while True:
        if hp["anneal_lr"]:
            lr = hp["lr"] * max(0.0, 1.0 - iteration / max(hp["iterations"], 1))
            for g in optimizer.param_groups:
                g["lr"] = lr
        t0 = time.perf_counter()
        finished: list[list[float]] = [[] for _ in range(n_env)]
        with torch.no_grad():
            for t in range(n_t):
                b_obs[t] = obs
                logits = actor(obs)
                log_p = logits.log_softmax(-1)
                noise = torch.empty_like(logits).exponential_(generator=sample_gen).log_()
                action = (logits - noise).argmax(-1, keepdim=True)  # [E, 1], Gumbel-max
                b_act[t] = action[:, 0]
                b_logp[t] = log_p.gather(-1, action)[:, 0]
                b_val[t] = critic(obs)[:, 0]
                obs_np, reward, term, trunc, info = envs.step(action[:, 0].numpy())
                done = term | trunc
                nxt = torch.as_tensor(obs_np, dtype=torch.float32).reshape(n_env, obs_dim)
                b_next_obs[t] = nxt
                running += reward
                if done.any():
                    for i in np.flatnonzero(done):
                        b_next_obs[t, i] = torch.as_tensor(info["final_obs"][i], dtype=torch.float32).reshape(-1)
                        finished[i].append(float(running[i]))
                        running[i] = 0.0
                b_rew[t] = torch.as_tensor(reward, dtype=torch.float32)
                b_term[t] = torch.as_tensor(term, dtype=torch.float32)
                b_done[t] = torch.as_tensor(done, dtype=torch.float32)
                obs = nxt
            # GAE over [T, E]: bootstrap on truncation and at the fragment end, not on termination.
            next_val = critic(b_next_obs.reshape(-1, obs_dim)).reshape(n_t, n_env)
            delta = b_rew + gamma * next_val * (1.0 - b_term) - b_val
            adv = torch.zeros(n_t, n_env)
            last = torch.zeros(n_env)
            for t in reversed(range(n_t)):
                last = delta[t] + gamma * lam * (1.0 - b_done[t]) * last
                adv[t] = last
            ret = adv + b_val
        env_steps += n_t * n_env
        for per_env in finished:  # env-then-time order, as Shoal's episode scan
            returns.extend(per_env)
            episodes += len(per_env)
        t1 = time.perf_counter()
        t_sample += t1 - t0

        # env-major, as Shoal's flattened [E, T] batch
        f_obs, f_act, f_logp = b_obs.transpose(0, 1).reshape(-1, obs_dim), b_act.t().reshape(-1), b_logp.t().reshape(-1)
        f_adv, f_ret = adv.t().reshape(-1), ret.t().reshape(-1)
        n = f_obs.shape[0]
        for _ in range(hp["num_epochs"]):
            perm = torch.randperm(n, generator=perm_gen)
            for s in range(0, n, hp["minibatch_size"]):
                idx = perm[s:s + hp["minibatch_size"]]
                log_p = actor(f_obs[idx]).log_softmax(-1)
                new_logp = log_p.gather(-1, f_act[idx].unsqueeze(-1))[:, 0]
                ratio = (new_logp - f_logp[idx]).exp()
                mb_adv = f_adv[idx]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + hp["advantage_eps"])
                pg_loss = -torch.min(ratio * mb_adv,
                                     ratio.clamp(1 - hp["clip_eps"], 1 + hp["clip_eps"]) * mb_adv).mean()
                v_loss = 0.5 * (critic(f_obs[idx])[:, 0] - f_ret[idx]).square().mean()
                loss = pg_loss + hp["value_coef"] * v_loss
                if hp["entropy_coef"]:
                    entropy = -(log_p.exp() * log_p).sum(-1).mean()
                    loss = loss - hp["entropy_coef"] * entropy
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, hp["max_grad_norm"])
                optimizer.step()
        t_update += time.perf_counter() - t1
        iteration += 1

        r = list(returns)
        for w in sorted({10, 100, window}):  # first iteration at which each window's mean reached the target
            if w not in first and len(r) >= w and sum(r[-w:]) / w >= stop_return:
                first[w] = {"time_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start,
                            "env_steps": env_steps, "iteration": iteration}
        reached = window in first
        out_of_time = deadline_s is not None and time.perf_counter() - start > deadline_s
        if reached or env_steps >= max_steps or out_of_time:
            break
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    envs.close()
    r = list(returns)
    modules = {"actor": actor, "critic": critic} if return_modules else {}
    return {
        **modules,
        "time_s": elapsed, "cpu_s": cpu, "env_steps": env_steps, "reached": reached, "iterations": iteration,
        "episodes": episodes, "first": {str(w): v for w, v in sorted(first.items())},
        "return_mean_10": sum(r[-10:]) / len(r[-10:]) if r else math.nan,
        "return_mean_100": sum(r) / len(r) if r else math.nan,
        "time_sample_s": t_sample, "time_update_s": t_update,
    }


if __name__ == "__main__":
    import json
    import sys

    torch.set_num_threads(1)
    print(json.dumps(run(DEFAULT_HPARAMS, seed=int(sys.argv[1]) if len(sys.argv) > 1 else 1, window=10)))
