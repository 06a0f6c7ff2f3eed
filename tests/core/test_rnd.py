"""Random network distillation math (core/losses/rnd.py): properties and reference loops."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from core.losses.rnd import (OBS_CLIP, intrinsic_returns, merged_observation_moments, normalized_observation,
                             prediction_error, rnd_loss, scaled_intrinsic_reward)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 12), d=st.integers(1, 5), scale=st.floats(0.1, 100.0))
def test_normalized_observations_are_standardised_then_clipped(seed, rows, d, scale):
    obs = torch.randn(rows, d, generator=_gen(seed), dtype=torch.float64) * scale
    mean, var = obs.mean(0) * 0.5, torch.full((d,), 0.25, dtype=torch.float64)
    x = normalized_observation(obs, mean, var)
    reference = ((obs - mean) / (var + 1e-8).sqrt()).clamp(-OBS_CLIP, OBS_CLIP).float()
    assert x.dtype == torch.float32 and x.abs().max() <= OBS_CLIP
    torch.testing.assert_close(x, reference)


@given(seed=st.integers(0, 2**31 - 1), e=st.integers(1, 4), t=st.integers(1, 5), a=st.integers(1, 3), cut=st.data())
def test_observation_moments_merge_like_one_pass_over_the_present_rows(seed, e, t, a, cut):
    g = _gen(seed)
    obs = torch.randn(e, t, a, 3, generator=g, dtype=torch.float64) * 3 + 1
    mask = torch.rand(e, t, a, generator=g) < 0.7
    k = cut.draw(st.integers(0, e), label="split")
    stats = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for part in ((slice(0, k)), slice(k, e)):  # two batches merged one after the other
        stats = merged_observation_moments(*stats, obs[part], mask[part])
    present = obs[mask]
    assert int(stats[2]) == present.shape[0]
    if present.shape[0]:
        torch.testing.assert_close(stats[0], present.mean(0))
        torch.testing.assert_close(stats[1], present.var(0, unbiased=False))


def test_prediction_error_is_the_feature_mean_of_squares_and_trains_only_the_predictor():
    predicted = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    target = torch.tensor([[0.0, 0.0], [3.0, 1.0]], requires_grad=True)
    err = prediction_error(predicted, target)
    assert err.shape == (2, 1) and torch.equal(err.detach(), torch.tensor([[2.5], [5.0]]))
    err.sum().backward()
    assert predicted.grad is not None and target.grad is None


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), p=st.sampled_from([0.25, 0.5, 1.0]))
def test_rnd_loss_averages_the_kept_present_samples_and_is_reproducible(seed, n, p):
    g = _gen(seed)
    predicted, target = torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)
    mask = torch.rand(n, generator=g) < 0.6
    terms = rnd_loss(predicted, target, mask, p, _gen(seed + 1))
    keep = mask & (torch.rand(n, generator=_gen(seed + 1)) < p)  # the same draws the loss made
    err = (predicted - target).square().mean(-1)
    expected = err[keep].mean() if keep.any() else torch.zeros(())
    torch.testing.assert_close(terms["loss_predictor"], expected)
    assert int(terms["kept"]) == int(keep.sum())
    if mask.any():
        torch.testing.assert_close(terms["prediction_error"], err[mask].mean())
    again = rnd_loss(predicted, target, mask, p, _gen(seed + 1))
    assert torch.equal(again["loss_predictor"], terms["loss_predictor"])
    if p == 1.0:  # every present sample trains
        assert int(terms["kept"]) == int(mask.sum())


@given(seed=st.integers(0, 2**31 - 1), e=st.integers(1, 3), t=st.integers(1, 6), a=st.integers(1, 2),
       gamma=st.sampled_from([0.0, 0.9, 0.99]))
def test_intrinsic_returns_match_a_non_episodic_reference_loop(seed, e, t, a, gamma):
    g = _gen(seed)
    reward = torch.rand(e, t, a, 1, generator=g)
    carry = torch.rand(e, a, generator=g, dtype=torch.float64)
    returns, out = intrinsic_returns(reward, gamma, carry)
    expected, c = torch.empty(e, t, a, dtype=torch.float64), carry.clone()
    for step in range(t):  # never reset: episode ends do not stop curiosity
        c = gamma * c + reward[:, step, :, 0].double()
        expected[:, step] = c
    torch.testing.assert_close(returns, expected)
    torch.testing.assert_close(out, c)


def test_intrinsic_rewards_are_divided_by_the_return_std_never_centred():
    reward = torch.tensor([[0.0], [2.0], [8.0]])
    scaled = scaled_intrinsic_reward(reward, torch.tensor(4.0, dtype=torch.float64))
    assert scaled.dtype == reward.dtype
    torch.testing.assert_close(scaled, reward / 2)


def test_distilling_a_fixed_random_network_lowers_the_error_of_familiar_observations_only():
    torch.manual_seed(0)
    target, predictor = torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(),
                                                                    torch.nn.Linear(32, 8))
    familiar, novel = torch.randn(64, 4) * 0.3, torch.randn(64, 4) * 0.3 + 3.0
    optimizer = torch.optim.Adam(predictor.parameters(), lr=1e-2)
    g = _gen(0)

    def error(x):
        with torch.no_grad():
            return float(prediction_error(predictor(x), target(x)).mean())

    before = error(familiar)
    for _ in range(200):
        loss = rnd_loss(predictor(familiar), target(familiar).detach(), None, 0.5, g)["loss_predictor"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert error(familiar) < 0.1 * before
    assert error(novel) > 10 * error(familiar)  # the bonus stays high where the agents have not been
