"""Reward scaling end to end: the statistics resume bit for bit from a checkpoint, evaluation and episode
metrics stay unscaled, and CartPole still learns with scaled rewards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensordict import TensorDict

from core.layout import DONE, FRAGMENT_ID, MASK, NEXT, REWARD, STREAM_RETURNS
from core.losses import PPOConfig
from core.policies import PolicyConfig
from core.policies.reward_scaling import RewardScaler, discounted_returns
from orchestration.builder import build_trainer
from orchestration.checkpoint import load_checkpoint, save_checkpoint
from orchestration.config import RolloutConfig, TrainConfig
from orchestration.reward_scaling import ReturnStreams
from orchestration.run_state import restore_trainer_, trainer_state

FAST = TrainConfig(env="builtin:cartpole", seed=1, lr=1e-3, iterations=4, policy=PolicyConfig(scale_rewards=True),
                   rollout=RolloutConfig(num_envs=8, fragment_length=64), ppo=PPOConfig(minibatch_size=128))


def _fragment(worker: int, sequence: int, reward: torch.Tensor) -> TensorDict:
    e, t, a, _ = reward.shape
    group = TensorDict({MASK: torch.ones(e, t, a, dtype=torch.bool)}, [e, t, a])
    nxt = TensorDict({"agents": TensorDict({REWARD: reward, DONE: torch.zeros(e, t, a, 1, dtype=torch.bool)},
                                           [e, t, a])}, [e, t])
    fid = torch.full((e, t), (worker << 32) | sequence, dtype=torch.int64)
    return TensorDict({"agents": group, NEXT: nxt, FRAGMENT_ID: fid}, [e, t])


def test_each_stream_carries_its_own_accumulator_and_a_reused_fragment_counts_once():
    g = torch.Generator().manual_seed(0)
    rewards = [torch.randn(2, 3, 2, 1, generator=g) for _ in range(3)]
    scaler = RewardScaler()
    streams = ReturnStreams(0.9, {"agents": torch.tensor([True, False])}, scaler)  # the policy acts for slot 0
    a0, b0, a1 = _fragment(0, 0, rewards[0]), _fragment(1, 0, rewards[1]), _fragment(0, 1, rewards[2])
    streams.observe_([a0, b0])
    streams.observe_([a0, a1])  # a0 again (asynchronous reuse): skipped
    whole, _ = discounted_returns(torch.cat([rewards[0], rewards[2]], 1), torch.zeros(2, 6, 2, 1, dtype=torch.bool),
                                  0.9, torch.zeros(2, 2, dtype=torch.float64))
    other, _ = discounted_returns(rewards[1], torch.zeros(2, 3, 2, 1, dtype=torch.bool), 0.9,
                                  torch.zeros(2, 2, dtype=torch.float64))
    seen = torch.cat([whole[..., 0].flatten(), other[..., 0].flatten()])  # slot 0 of both streams, once each
    assert int(scaler.return_count) == seen.numel() == 18
    torch.testing.assert_close(scaler.return_var, seen.var(unbiased=False))
    assert streams.sequence == {0: 1, 1: 0}
    restored = ReturnStreams(0.9, {"agents": None}, RewardScaler())
    restored.load_state_({k: v.numpy() for k, v in streams.state().items()})
    assert restored.sequence == streams.sequence
    assert all(torch.equal(v, restored.carry[k]) for k, v in streams.carry.items())


def test_shards_of_a_batch_count_every_streams_returns_once_whatever_rows_each_data_parallel_rank_gets():
    """A data-parallel rank 0 annotates whole fragments, then splits the batch by env rows: an asynchronous batch
    (arrival order, reuse) puts other streams' rows in each shard from batch to batch. The shards' returns must
    still be each stream's own, counted once (observing both shards equals the ranks' summed moments)."""
    g = torch.Generator().manual_seed(1)
    r = {k: torch.randn(2, 3, 2, 1, generator=g) for k in ("a0", "b0", "a1", "b1")}
    f = {k: _fragment(int(k[0] == "b"), int(k[1]), v) for k, v in r.items()}
    scaler = RewardScaler()
    streams = ReturnStreams(0.9, {"agents": None}, scaler)
    for batch in (["a0", "b0"], ["b1", "a1", "a0"]):  # the second: shard 0 holds b1 and a row of a1; a0 reused
        annotated = torch.cat([streams.annotated(f[k]) for k in batch])
        assert len(batch) == 2 or not annotated[STREAM_RETURNS, "agents", "mask"][-2:].any()  # a0 again: not counted
        for shard in annotated.split(annotated.shape[0] // 2):
            streams.observe_([shard])
    done = torch.zeros(2, 6, 2, 1, dtype=torch.bool)
    seen = torch.cat([discounted_returns(torch.cat([r[f"{s}0"], r[f"{s}1"]], 1), done, 0.9,
                                         torch.zeros(2, 2, dtype=torch.float64))[0].flatten() for s in "ab"])
    assert int(scaler.return_count) == seen.numel() == 48
    torch.testing.assert_close(scaler.return_mean, seen.mean())
    torch.testing.assert_close(scaler.return_var, seen.var(unbiased=False))


def test_return_statistics_and_accumulators_resume_bit_for_bit_from_a_checkpoint(tmp_path):
    straight = build_trainer(FAST)
    expected = [straight.train() for _ in range(4)]
    first = build_trainer(FAST)
    got = [first.train() for _ in range(2)]
    weights, tensors, state = trainer_state(first)
    assert "returns/agent/carry/0/agent" in tensors and "agent/reward_scaler.return_var" in weights
    save_checkpoint(tmp_path, first.iteration, weights=weights, tensors=tensors, state=state)
    resumed = build_trainer(FAST)  # a fresh trainer, as after a restart
    restore_trainer_(resumed, *load_checkpoint(tmp_path))
    got += [resumed.train() for _ in range(2)]
    for a, b in zip(expected, got):
        for key in ("reward_scale", "loss_value", "approx_kl", "episode_return_mean"):
            assert a[key] == b[key], key
    ours, theirs = straight.learners["agent"], resumed.learners["agent"]
    for name, value in ours.policy.state_dict().items():
        assert torch.equal(value, theirs.policy.state_dict()[name]), name
    assert ours.returns.sequence == theirs.returns.sequence == {0: 3}
    assert all(torch.equal(c, theirs.returns.carry[k]) for k, c in ours.returns.carry.items())
    assert int(ours.policy.reward_scaler.return_count) == 4 * 8 * 64
    for trainer in (straight, first, resumed):
        trainer.close()


def test_evaluation_and_episode_metrics_see_raw_rewards_and_leave_the_statistics_alone():
    trainer = build_trainer(dataclasses.replace(FAST, eval_every=1, eval_episodes=4))
    metrics = trainer.train()
    scaler = trainer.learners["agent"].policy.reward_scaler
    assert metrics["reward_scale"] > 2.0  # CartPole's returns of ~20 steps: rewards of 1 become well below 1
    assert metrics["episode_return_mean"] == metrics["episode_length_mean"]  # a reward of 1 per step, unscaled
    before = {k: v.clone() for k, v in scaler.state_dict().items()}
    evaluation = trainer.evaluate()
    assert evaluation["eval_return_mean"] >= 8  # raw steps survived, not rewards divided by ~5
    assert all(torch.equal(v, scaler.state_dict()[k]) for k, v in before.items())
    evaluator = trainer.evaluator.policies["agent"].reward_scaler
    assert torch.equal(evaluator.return_var, scaler.return_var)  # received with the weights, never updated
    trainer.close()


@pytest.mark.slow
def test_cartpole_learns_with_scaled_rewards_within_a_step_budget():
    config = dataclasses.replace(FAST, seed=0, lr=2.5e-3, iterations=20,
                                 rollout=RolloutConfig(num_envs=16, fragment_length=64),
                                 ppo=PPOConfig(minibatch_size=256, num_epochs=4))
    trainer = build_trainer(config)
    returns = []
    for _ in range(config.iterations):  # budget: 20 x 1024 env steps; a random policy's episodes last ~20 steps
        returns.append(trainer.train()["episode_return_mean_10"])
        if returns[-1] >= 195:
            break
    trainer.close()
    assert max(returns) >= 195, f"mean return of the last 10 episodes: {returns}"
