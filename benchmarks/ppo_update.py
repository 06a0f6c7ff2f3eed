"""PPO update throughput: Shoal's ``ppo_update_`` against a minimal hand-written torch PPO loop.

Both train the same nets (actor and critic, separate 64x64 tanh MLPs, 4-dim observations, 2 discrete
actions) on the same 4096 samples, minibatch 128, 4 epochs, same fused Adam, same permutations, same loss
(clipped surrogate, value MSE, entropy bonus, per-minibatch advantage normalisation, grad-norm clip 0.5).
Repeats are interleaved (ours, hand, ours, hand, ...) and each side's median is reported. Prints one JSON.

    python benchmarks/ppo_update.py            # full run
    python benchmarks/ppo_update.py --quick    # smoke run (CI)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from tensordict import TensorDict

from core.losses import PPOConfig, ppo_update_

GROUP = "agents"
OBS_DIM, NUM_ACTIONS = 4, 2


def mlp(out: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(OBS_DIM, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, out),
    )


def make_batch(actor, critic, n: int, seed: int) -> TensorDict:
    """A flat ``[n]`` batch in Shoal's layout: one group of one agent, behaviour entries ``[n, 1, 1]``."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, 1, OBS_DIM, generator=g)
    with torch.no_grad():
        logits = actor(obs)
        action = torch.multinomial(logits.softmax(-1).reshape(n, -1), 1, generator=g)  # [n, 1]
        log_prob = logits.log_softmax(-1).gather(-1, action.unsqueeze(-1))
        value = critic(obs)
    advantage = torch.randn(n, 1, 1, generator=g)
    agents = TensorDict(
        observation=obs, action=action, log_prob=log_prob, state_value=value, advantage=advantage,
        value_target=advantage + value, batch_size=[n, 1],
    )
    nxt = TensorDict({GROUP: TensorDict(observation=torch.randn(n, 1, OBS_DIM, generator=g),
                                        reward=torch.randn(n, 1, 1, generator=g), batch_size=[n, 1])},
                     batch_size=[n])
    return TensorDict({GROUP: agents, "next": nxt}, batch_size=[n])


def make_evaluate(actor, critic):
    """The forward pass on a minibatch: plain tensors in, a plain dict out."""
    def evaluate(mb):
        obs, action = mb[GROUP, "observation"], mb[GROUP, "action"]
        log_p = actor(obs).log_softmax(-1)  # [n, 1, 2]
        return {
            "log_prob": log_p.gather(-1, action.unsqueeze(-1)),
            "state_value": critic(obs),
            "entropy": -(log_p.exp() * log_p).sum(-1, keepdim=True),
        }
    return evaluate


def hand_update(actor, critic, optimizer, batch: TensorDict, cfg: PPOConfig, generator: torch.Generator) -> None:
    """A minimal CleanRL-style PPO loop on raw tensors (no diagnostics, no guard)."""
    b = batch[GROUP]
    b_obs, b_act, b_lp, b_adv, b_ret = (b[k] for k in ("observation", "action", "log_prob", "advantage",
                                                        "value_target"))
    params = [*actor.parameters(), *critic.parameters()]
    n = b_obs.shape[0]
    for _ in range(cfg.num_epochs):
        perm = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.minibatch_size):
            idx = perm[start:start + cfg.minibatch_size]
            obs, adv = b_obs[idx], b_adv[idx]
            log_p = actor(obs).log_softmax(-1)
            new_lp = log_p.gather(-1, b_act[idx].unsqueeze(-1))
            entropy = -(log_p.exp() * log_p).sum(-1, keepdim=True)
            value = critic(obs)
            ratio = (new_lp - b_lp[idx]).exp()
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            pg_loss = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv).mean()
            v_loss = 0.5 * (value - b_ret[idx]).square().mean()
            loss = pg_loss + cfg.value_coef * v_loss - cfg.entropy_coef * entropy.mean()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small batch, one repeat")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, repeats = (512, 1) if args.quick else (4096, args.repeats)
    cfg = PPOConfig(num_epochs=4, minibatch_size=128, entropy_coef=0.01, max_grad_norm=0.5)
    torch.manual_seed(0)  # benchmark script, not core: fixes the initial weights
    actor0, critic0 = mlp(NUM_ACTIONS), mlp(1)
    batch = make_batch(actor0, critic0, n, seed=1)

    def fresh():
        actor, critic = copy.deepcopy(actor0), copy.deepcopy(critic0)
        opt = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=2.5e-4, eps=1e-5, fused=True)
        return actor, critic, opt

    def run_ours():
        actor, critic, opt = fresh()
        nets = torch.nn.ModuleList([actor, critic])
        t0 = time.perf_counter()
        metrics = ppo_update_(nets, opt, batch, make_evaluate(actor, critic), cfg, torch.Generator().manual_seed(2),
                              group=GROUP)
        return time.perf_counter() - t0, nets, metrics

    def run_hand():
        actor, critic, opt = fresh()
        t0 = time.perf_counter()
        hand_update(actor, critic, opt, batch, cfg, torch.Generator().manual_seed(2))
        return time.perf_counter() - t0, torch.nn.ModuleList([actor, critic]), None

    run_ours(), run_hand()  # warm-up
    ours, hand = [], []
    for _ in range(repeats):
        t, nets_ours, metrics = run_ours()
        ours.append(t)
        t, nets_hand, _ = run_hand()
        hand.append(t)
    max_param_diff = max((a - b).abs().max().item() for a, b in zip(nets_ours.parameters(), nets_hand.parameters()))
    samples = n * cfg.num_epochs
    ours_sps, hand_sps = samples / statistics.median(ours), samples / statistics.median(hand)
    print(json.dumps({
        "benchmark": "ppo_update", "quick": args.quick, "samples": n, "minibatch_size": cfg.minibatch_size,
        "num_epochs": cfg.num_epochs, "repeats": repeats, "threads": torch.get_num_threads(),
        "ours_samples_per_s": round(ours_sps), "hand_samples_per_s": round(hand_sps),
        "ratio_ours_over_hand": round(ours_sps / hand_sps, 3),
        "ratio_median_of_pairs": round(statistics.median(h / o for o, h in zip(ours, hand)), 3),
        "ours_ms": [round(1e3 * t, 1) for t in ours], "hand_ms": [round(1e3 * t, 1) for t in hand],
        "max_param_diff_ours_vs_hand": max_param_diff,
        "ours_metrics": {k: round(v.item(), 5) for k, v in metrics.items()},
    }))


if __name__ == "__main__":
    main()
