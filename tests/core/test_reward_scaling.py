"""Reward scaling's math against plain Python loops, and the statistics as part of the policy's state."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.layout import NEXT, REWARD
from core.policies import PolicyConfig, make_policies
from core.policies.reward_scaling import (CLIP, EPS, RewardScaler, discounted_returns, merge_moments, scaled,
                                          with_scaled_rewards)
from core.specs import AgentNode, ArrayPopulation, Leaf


@st.composite
def streams(draw, max_envs: int = 3, max_steps: int = 9, max_agents: int = 3) -> dict:
    """A reward stream ``[E, T, A, 1]`` with drawn dones and NaN padding, cut into fragments along time."""
    e, t, a = (draw(st.integers(1, m), label=n) for m, n in ((max_envs, "E"), (max_steps, "T"), (max_agents, "A")))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    p_done = draw(st.sampled_from([0.0, 0.2, 0.5, 1.0]), label="p_done")
    reward = torch.randn(e, t, a, 1, generator=g) * draw(st.sampled_from([0.01, 1.0, 100.0]), label="scale")
    reward = reward.masked_fill(torch.rand(e, t, a, 1, generator=g) < 0.1, math.nan)  # absent agents' padding
    cuts = sorted(set(draw(st.lists(st.integers(1, t - 1), max_size=3), label="cuts"))) if t > 1 else []
    return {"reward": reward, "done": torch.rand(e, t, a, 1, generator=g) < p_done,
            "gamma": draw(st.sampled_from([0.0, 0.5, 0.99, 1.0]), label="gamma"), "cuts": [0, *cuts, t],
            "carry": torch.randn(e, a, generator=g, dtype=torch.float64)}


def _reference_returns(reward, done, gamma, carry):
    """The textbook loop: one accumulator per (env, agent), reset after every done (SB3's VecNormalize)."""
    e, t, a, _ = reward.shape
    out = [[[0.0] * a for _ in range(t)] for _ in range(e)]
    last = [[0.0] * a for _ in range(e)]
    for i in range(e):
        for k in range(a):
            c = float(carry[i, k])
            for s in range(t):
                r = float(reward[i, s, k, 0])
                g = gamma * c + (r if math.isfinite(r) else 0.0)
                out[i][s][k] = g
                c = 0.0 if bool(done[i, s, k, 0]) else g
            last[i][k] = c
    return torch.tensor(out, dtype=torch.float64), torch.tensor(last, dtype=torch.float64)


@given(stream=streams())
def test_discounted_returns_over_fragments_equal_the_reference_loop_over_the_whole_stream(stream):
    reward, done, gamma, carry = stream["reward"], stream["done"], stream["gamma"], stream["carry"]
    expected, expected_carry = _reference_returns(reward, done, gamma, carry)
    pieces, c = [], carry
    for lo, hi in zip(stream["cuts"], stream["cuts"][1:]):  # fragment by fragment, the accumulator carried over
        returns, c = discounted_returns(reward[:, lo:hi], done[:, lo:hi], gamma, c)
        pieces.append(returns)
    assert torch.equal(torch.cat(pieces, 1), expected)  # same float64 operations in the same order: bit for bit
    assert torch.equal(c, expected_carry)
    assert torch.equal(carry, stream["carry"])  # inputs untouched


@given(data=st.data(), n=st.integers(0, 40), seed=st.integers(0, 2**31 - 1))
def test_merged_moments_equal_the_moments_of_everything_seen(data, n, seed):
    values = (torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3 + 5).tolist()
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4), label="cuts"))
    mean, var, count = (torch.tensor(v, dtype=torch.float64) for v in (0.0, 1.0, 0.0))
    for lo, hi in zip([0, *cuts], [*cuts, n]):
        mean, var, count = merge_moments(mean, var, count, torch.tensor(values[lo:hi], dtype=torch.float64))
    assert int(count) == n
    if n == 0:
        assert float(mean) == 0.0 and float(var) == 1.0  # no data: the prior, untouched
        return
    ref_mean = math.fsum(values) / n
    ref_var = math.fsum((v - ref_mean) ** 2 for v in values) / n
    assert math.isclose(float(mean), ref_mean, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(float(var), ref_var, rel_tol=1e-9, abs_tol=1e-12)


@given(x=st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=8), var=st.floats(0.0, 1e6))
def test_scaled_rewards_are_divided_by_the_return_std_and_clipped(x, var):
    reward = torch.tensor(x, dtype=torch.float32)
    out = scaled(reward, torch.tensor(var, dtype=torch.float64))
    for r, s in zip(x, out.tolist()):
        expected = min(max(r / math.sqrt(var + EPS), -CLIP), CLIP)
        assert math.isclose(s, expected, rel_tol=1e-5, abs_tol=1e-6)
        assert (s > 0) == (r > 0) or abs(expected) < 1e-6  # dividing never flips a sign (no centring)


def test_the_scaler_keeps_masked_statistics_in_persistent_buffers_and_scales_one_group():
    scaler = RewardScaler()
    g = torch.Generator().manual_seed(0)
    returns, mask = torch.randn(4, 5, 2, generator=g, dtype=torch.float64) * 7, torch.rand(4, 5, 2, generator=g) > 0.4
    scaler.observe_(returns, mask)
    torch.testing.assert_close(scaler.return_var, returns[mask].var(unbiased=False))
    assert int(scaler.return_count) == int(mask.sum())
    assert set(scaler.state_dict()) == {"return_mean", "return_var", "return_count"}
    reward = torch.randn(4, 5, 2, 1, generator=g)
    rollout = TensorDict({NEXT: TensorDict({"agents": TensorDict({REWARD: reward}, [4, 5, 2]),
                                            "other": TensorDict({REWARD: reward}, [4, 5, 2])}, [4, 5])}, [4, 5])
    out = with_scaled_rewards(rollout, "agents", scaler)
    torch.testing.assert_close(out.get((NEXT, "agents", REWARD)), scaled(reward, scaler.return_var))
    assert out.get((NEXT, "other", REWARD)) is reward and rollout.get((NEXT, "agents", REWARD)) is reward


def test_the_statistics_are_policy_buffers_only_when_asked_for():
    tree = ArrayPopulation(template=AgentNode(observation=Leaf.box((3,)), action=Leaf.discrete(2)), capacity=2)
    (plain,) = make_policies(tree, PolicyConfig()).values()
    (scaling,) = make_policies(tree, PolicyConfig(scale_rewards=True)).values()
    assert plain.reward_scaler is None and not any("return_" in k for k in plain.state_dict())
    assert {"reward_scaler.return_var", "reward_scaler.return_count"} <= set(scaling.state_dict())
    weights = TensorDict.from_module(scaling)  # what actors receive: the statistics travel with the weights
    assert weights.get(("reward_scaler", "return_var")).dtype == torch.float64


def test_copies_that_add_up_their_sums_merge_the_moments_of_the_whole_batch():
    """Data-parallel ranks (``reduce``): each copy observes its shard and adds the others' ``sums_of``; every
    copy then holds the statistics of one scaler that saw every return."""
    from core.policies.reward_scaling import sums_of

    whole, copies = RewardScaler(), [RewardScaler(), RewardScaler()]
    g = torch.Generator().manual_seed(2)
    for scale in (1.0, 30.0, 0.2):
        returns = torch.randn(6, 5, 3, generator=g, dtype=torch.float64) * scale
        mask = torch.rand(6, 5, 3, generator=g) > 0.25
        whole.observe_(returns, mask)
        shards = [(returns[:2], mask[:2]), (returns[2:], mask[2:])]
        sums = [sums_of(r.reshape(-1)[m.reshape(-1)]) for r, m in shards]
        for k, (copy, (r, m)) in enumerate(zip(copies, shards)):
            copy.observe_(r, m, reduce=lambda t, k=k: t + sums[1 - k])
    for copy in copies:
        for name, value in whole.state_dict().items():
            torch.testing.assert_close(copy.state_dict()[name], value)
