"""``--ppo.advantage vtrace``: V-trace advantages and value targets with the log-probabilities of the recorded
actions under the policy being trained, on both backends."""

from __future__ import annotations

import pytest
import torch

from core.layout import ACTION_MASK, DONE, LOG_PROB, NEXT, REWARD, STATE_VALUE, TERMINATED
from core.losses import PPOConfig, with_gae, with_vtrace
from core.policies import PolicyConfig, make_policies
from core.specs import rand
from orchestration.config import RayConfig, RolloutConfig, TrainConfig


def _batch(tree, e: int, t: int, seed: int = 0):
    """A random ``[E, T]`` batch of CartPole's tree with everything the estimators read."""
    g = torch.Generator().manual_seed(seed)
    batch = rand(tree, (e, t), g)
    agent = batch.get("agent")
    agent.del_(ACTION_MASK)
    agent.set(LOG_PROB, -torch.rand(e, t, 1, 1, generator=g) - 0.1)  # behaviour: not the policy's own
    agent.set(STATE_VALUE, torch.randn(e, t, 1, 1, generator=g))
    done = torch.rand(e, t, 1, 1, generator=g) < 0.1
    batch.set(NEXT, rand(tree, (e, t), g).exclude(("agent", ACTION_MASK), ("agent", "action")))
    nxt = batch.get(NEXT).get("agent")
    for key, value in ((REWARD, torch.ones(e, t, 1, 1)), (DONE, done), (TERMINATED, done),
                       (STATE_VALUE, torch.randn(e, t, 1, 1, generator=g))):
        nxt.set(key, value)
    return batch


def test_vtrace_reads_the_current_policys_log_probs_chunk_by_chunk(monkeypatch):
    from orchestration import train_batches
    from orchestration.envs import make_env

    env = make_env("builtin:cartpole", 1)
    tree = env.tree
    env.close()
    policy = make_policies(tree, PolicyConfig())["agent"]
    batch = _batch(tree, 6, 5)
    with torch.no_grad():
        target = policy.evaluate_terms(batch.get("agent"))[LOG_PROB]
        expected = with_vtrace(batch.clone(), "agent", 0.99, target_log_prob=target)
        monkeypatch.setattr(train_batches, "VALUE_CHUNK", 2)  # env rows two at a time
        got = train_batches.with_advantages(policy, batch.clone(), "agent", PPOConfig(advantage="vtrace"))
        gae = train_batches.with_advantages(policy, batch.clone(), "agent", PPOConfig())
    for key in ("advantage", "value_target"):
        torch.testing.assert_close(got.get(("agent", key)), expected.get(("agent", key)))
    torch.testing.assert_close(gae.get(("agent", "advantage")),
                               with_gae(batch.clone(), "agent", 0.99, 0.95).get(("agent", "advantage")))
    assert not torch.allclose(got.get(("agent", "advantage")), gae.get(("agent", "advantage")))


def test_with_vtrace_the_ppo_ratio_is_taken_against_the_policy_as_the_update_starts():
    """Decoupled PPO: V-trace's advantage holds the behaviour correction (rho, truncated at 1); PPO's ratio against
    the behaviour log-prob on top of it weighed an off-policy sample rho * pi / mu (the audit: 0.0625 for a
    sample IMPALA weighs 0.25, -4 for one it weighs -1). At the update's first step the ratio is now 1."""
    from core.losses import ppo_loss
    from orchestration import train_batches
    from orchestration.envs import make_env

    env = make_env("builtin:cartpole", 1)
    policy = make_policies(env.tree, PolicyConfig())["agent"]
    batch = _batch(env.tree, 6, 5)
    env.close()
    behaviour = batch.get(("agent", LOG_PROB)).clone()
    with torch.no_grad():
        got = train_batches.with_advantages(policy, batch.clone(), "agent", PPOConfig(advantage="vtrace"))
        now = policy.evaluate_terms(batch.get("agent"))
    torch.testing.assert_close(got.get(("agent", LOG_PROB)), now[LOG_PROB])  # PPO's reference: the policy now
    assert not torch.allclose(behaviour, now[LOG_PROB])  # (the behaviour's differs: V-trace corrected for it)
    terms = ppo_loss(got.get("agent"), now, PPOConfig(normalize_advantage=False))
    assert float(terms["clip_fraction"]) == 0.0 and abs(float(terms["approx_kl"])) < 1e-6


def test_vtrace_is_refused_for_a_recurrent_policy():
    with pytest.raises(ValueError, match="--ppo.advantage vtrace: feed-forward policies only"):
        TrainConfig(ppo=PPOConfig(advantage="vtrace"), policy=PolicyConfig(recurrent=True))
    with pytest.raises(ValueError, match=r"PPOConfig.advantage must be one of \('gae', 'vtrace'\)"):
        PPOConfig(advantage="v-trace")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.ray)])
def test_async_ppo_with_vtrace_learns_cartpole(backend, request):
    """The same config on both backends; a fixed step budget and seed (the local run reached 267 here)."""
    from orchestration.builder import build_trainer

    if backend == "ray":
        request.getfixturevalue("ray_session")
    iterations = 20 if backend == "local" else 4
    config = TrainConfig(env="builtin:cartpole", seed=0, mode="async", backend=backend, lr=2.5e-3, max_staleness=2,
                         ppo=PPOConfig(advantage="vtrace", minibatch_size=256), iterations=iterations,
                         rollout=RolloutConfig(num_envs=16, fragment_length=64, num_workers=2),
                         ray=RayConfig(learner_num_cpus=0, worker_num_cpus=0.5))
    trainer = build_trainer(config)
    try:
        returns = [trainer.train().get("episode_return_mean", 0.0) for _ in range(iterations)]
        accounting = trainer.accounting()
    finally:
        trainer.close()
    assert accounting["fragments_produced"] == accounting["fragments_accepted"] + accounting["fragments_stale"] + \
        accounting["fragments_lost"] + accounting["fragments_in_flight"]
    if backend == "local":
        assert returns[-1] > 150, returns  # random play: ~22
    else:
        assert returns[-1] > returns[0], returns
