"""A one-screen tour of Shoal: PPO on CartPole, put together from the library's own parts.

Read it top to bottom. ``shoal train`` runs the same loop through ``orchestration.builder.build_trainer``
(plus checkpoints, logging, evaluation, Ray); here every step is spelled out once:

1. an adapter: Shoal's vectorised torch CartPole behind the batched-env protocol (``adapters/``);
2. policies built from the env's observation/action tree (``core.policies``);
3. an actor that acts in every env with one batched forward and records fragments ``[env, time]``;
4. critic values, then GAE (``core.losses.with_gae``: TorchRL's functional estimator in Shoal's layout);
5. the PPO update (``core.losses.ppo_update_``: epochs x minibatches of clipped PPO);
6. new weights to the actor, at the fragment boundary.

    python examples/tour.py --iterations 30      # mean episode return climbs from ~20 towards 500
"""

from __future__ import annotations

import argparse
import copy

import torch
from tensordict import TensorDict

from adapters.builtin.cartpole import CartPole, CartPoleConfig
from core.buffers import flatten_transitions
from core.layout import NEXT, OBSERVATION, STATE_VALUE
from core.losses import PPOConfig, ppo_update_, with_gae
from core.policies import PolicyConfig, make_policies
from orchestration.actor import Actor
from orchestration.assignment import assign


def tour(iterations: int = 30, seed: int = 0, num_envs: int = 16, fragment_length: int = 64,
         lr: float = 2.5e-3) -> list[float]:
    """Trains for ``iterations`` and returns the mean return of the episodes finished in each iteration."""
    torch.manual_seed(seed)  # initial weights: the one use of the global generator, at the entry point
    env = CartPole(CartPoleConfig(num_envs=num_envs))  # group "agent": observation [E, 1, 4], action [E, 1]
    policies = make_policies(env.tree, PolicyConfig(hidden_sizes=(64, 64)))  # one GroupPolicy per group
    [(group, policy)] = policies.items()  # CartPole has one group, hence one policy
    acting = {group: copy.deepcopy(policy)}  # the actor acts with its own copy, as a remote worker would
    actor = Actor(env, acting, assign(env.tree), fragment_length=fragment_length, seed=seed)
    ppo = PPOConfig(minibatch_size=256)  # clip 0.2, 4 epochs, GAE(0.99, 0.95), grad-norm 0.5: CleanRL's
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr, eps=1e-5)
    generator = torch.Generator().manual_seed(seed)  # minibatch order
    curve = []
    for iteration in range(iterations):
        # -- collect: one fragment, batch [env, time]; the next observation and reward live under "next"
        fragment = actor.collect()
        returns = actor.completed_episodes().get("return", [])
        curve.append(float(sum(returns) / len(returns)) if len(returns) else float("nan"))

        # -- advantages: the critic at s_t and s_{t+1}, then GAE (truncations bootstrap, terminations do not)
        with torch.no_grad():
            for root in (fragment, fragment.get(NEXT)):
                obs = root.get(group).select(OBSERVATION)
                root.get(group).set(STATE_VALUE, policy.value(obs))
            batch = with_gae(fragment, group, ppo.gamma, ppo.gae_lambda)

        # -- learn: flatten [env, time] -> [N] transitions and run the clipped-PPO epochs
        for param_group in optimizer.param_groups:  # linear annealing to 0 (37 details, detail 4)
            param_group["lr"] = lr * (1.0 - iteration / iterations)
        metrics = ppo_update_(policy, optimizer, flatten_transitions(batch),
                              lambda mb: policy.evaluate_terms(mb.get(group)), ppo, generator, group=group)

        # -- publish: the actor loads version ``iteration + 1`` before its next fragment
        actor.set_weights(group, iteration + 1, TensorDict.from_module(policy).detach())
        print(f"iteration {iteration:3d}  return {curve[-1]:7.1f}  loss_value {float(metrics['loss_value']):8.3f}"
              f"  approx_kl {float(metrics['approx_kl']):.4f}")
    env.close()
    return curve


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # 64x64 MLPs: one thread is fastest
    tour(args.iterations, args.seed)
