"""Adversarial env sampling and prior distributions (core.envsets): pure selection logic, statistical tests."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.envsets import AdversarialSet, Choice, CollectionError, EnvCollection, Normal, PriorDistribution, Uniform

ALPHA = 1e-3  # false-alarm rate of each statistical test (its seed is fixed, so it is deterministic anyway)
DRAWS = 4000
KS_DRAWS = 20_000  # the DKW bound is then 0.014: a Normal's std 10% off (max CDF gap about 0.025) fails


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """The ``1 - alpha`` quantile of chi-square(df): scipy when installed, else Wilson-Hilferty by hand."""
    try:
        from scipy.stats import chi2
    except ImportError:
        return wilson_hilferty(df, alpha)
    return float(chi2.ppf(1 - alpha, df))


def wilson_hilferty(df: int, alpha: float) -> float:
    """The chi-square quantile by hand: exact for df 1 (a squared normal) and 2 (an exponential), else the
    Wilson-Hilferty cube-root approximation."""
    if df == 1:
        return NormalDist().inv_cdf(1 - alpha / 2) ** 2
    if df == 2:
        return -2 * math.log(alpha)
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def dkw_bound(n: int, alpha: float = ALPHA) -> float:
    """Dvoretzky-Kiefer-Wolfowitz (Massart): P(sup |F_n - F| > eps) <= 2 exp(-2 n eps^2), solved for eps."""
    return math.sqrt(math.log(2 / alpha) / (2 * n))


def max_cdf_deviation(samples: torch.Tensor, cdf, cdf_left=None) -> float:
    """sup_x |F_n(x) - F(x)|, checked on both sides of every sample value (exact with atoms and ties)."""
    cdf_left = cdf_left or cdf
    values, counts = torch.unique(samples, sorted=True, return_counts=True)
    at = (torch.cumsum(counts, 0).double() / samples.numel()).tolist()  # F_n(x)
    before = [a - c / samples.numel() for a, c in zip(at, counts.tolist())]  # F_n(x-)
    return max(max(abs(a - cdf(v)), abs(b - cdf_left(v))) for v, a, b in zip(values.tolist(), at, before))


# ------------------------------------------------------------------------------------------------ adversarial


def test_the_adversarial_sampler_favours_the_lowest_return_and_follows_the_softmax():
    returns = {"a": 10.0, "b": 4.0, "c": -2.0, "d": 7.0}
    adversarial = AdversarialSet(ids=("a", "b", "c", "d"), temperature=0.5)
    low, high = min(returns.values()), max(returns.values())
    logits = [-(returns[i] - low) / (high - low) / 0.5 for i in adversarial.ids]  # by hand, not the code's
    expected = [math.exp(x) / sum(math.exp(y) for y in logits) for x in logits]
    torch.testing.assert_close(adversarial.probabilities(returns), torch.tensor(expected, dtype=torch.float64))
    draws = adversarial.draw(returns, DRAWS, _gen(0))
    counts = [draws.count(i) for i in adversarial.ids]
    assert max(adversarial.ids, key=draws.count) == "c"
    assert chi2_statistic(counts, expected) < chi2_critical(df=3), counts


def test_envs_never_measured_get_the_highest_weight():
    adversarial = AdversarialSet(ids=("seen_good", "seen_bad", "unseen", "nan"), temperature=1.0)
    p = adversarial.probabilities({"seen_good": 3.0, "seen_bad": 1.0, "nan": math.nan})
    assert p[2] == p.max() and p[3] == p.max() and p[0] < p[1]
    torch.testing.assert_close(adversarial.probabilities({}), torch.full((4,), 0.25, dtype=torch.float64))


@given(returns=st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=6), temperature=st.floats(0.05, 20))
def test_adversarial_weights_never_favour_a_better_env(returns, temperature):
    ids = tuple(f"e{k}" for k in range(len(returns)))
    p = AdversarialSet(ids=ids, temperature=temperature).probabilities(dict(zip(ids, returns))).tolist()
    assert math.isclose(sum(p), 1.0, rel_tol=1e-9)
    for i in range(len(ids)):
        for j in range(len(ids)):
            if returns[i] < returns[j]:
                assert p[i] >= p[j]


def test_adversarial_update_records_the_metric_and_leaves_its_input_alone():
    adversarial = AdversarialSet(ids=("a", "b"), metric="mean_return")
    state = {"a": 1.0}
    new = adversarial.update(state, {"b": {"mean_return": 2.0}})
    assert state == {"a": 1.0} and new == {"a": 1.0, "b": 2.0}
    with pytest.raises(CollectionError, match="closest reported: 'mean_retrn'"):
        adversarial.update(state, {"a": {"mean_retrn": 2.0}})


# ---------------------------------------------------------------------------------------------------- priors


def _normal_cdf(mean: float, std: float):
    return lambda x: 0.5 * (1 + math.erf((x - mean) / (std * math.sqrt(2))))


def test_uniform_prior_follows_its_cdf():
    x = Uniform(low=-2.0, high=3.0).sample(KS_DRAWS, _gen(1))
    assert x.shape == (KS_DRAWS,) and x.dtype == torch.float64 and bool(((x >= -2) & (x < 3)).all())
    assert max_cdf_deviation(x, lambda v: min(max((v + 2) / 5, 0.0), 1.0)) < dkw_bound(KS_DRAWS)


def test_normal_prior_follows_its_cdf():
    x = Normal(mean=1.5, std=2.0).sample(KS_DRAWS, _gen(2))
    assert max_cdf_deviation(x, _normal_cdf(1.5, 2.0)) < dkw_bound(KS_DRAWS)


def test_clipped_normal_prior_puts_the_tails_on_the_bounds():
    lo, hi = -0.5, 1.5
    phi = _normal_cdf(0.0, 1.0)
    x = Normal(mean=0.0, std=1.0, clip=(lo, hi)).sample(KS_DRAWS, _gen(3))
    assert bool(((x >= lo) & (x <= hi)).all())
    cdf = lambda v: 0.0 if v < lo else (1.0 if v >= hi else phi(v))  # noqa: E731
    cdf_left = lambda v: 0.0 if v <= lo else (1.0 if v > hi else phi(v))  # noqa: E731
    assert max_cdf_deviation(x, cdf, cdf_left) < dkw_bound(KS_DRAWS)


def test_choice_prior_follows_its_probabilities():
    choice = Choice(values=(1, 2, 5), probs=(0.2, 0.5, 0.3))
    x = choice.sample(DRAWS, _gen(4))
    assert x.dtype == torch.int64
    counts = [int((x == v).sum()) for v in (1, 2, 5)]
    assert sum(counts) == DRAWS and chi2_statistic(counts, [0.2, 0.5, 0.3]) < chi2_critical(df=2), counts
    uniform = Choice(values=(0.5, 1.5)).sample(DRAWS, _gen(5))
    assert uniform.dtype == torch.float64
    assert chi2_statistic([int((uniform == v).sum()) for v in (0.5, 1.5)], [0.5, 0.5]) < chi2_critical(df=1)


def test_prior_samples_every_parameter_deterministically_whatever_the_declaration_order():
    params = {"gravity": Uniform(low=8.0, high=12.0), "length": Normal(mean=1.0, std=0.1, clip=(0.5, 1.5)),
              "mass": Choice(values=(1, 2))}
    a = PriorDistribution(id="pendulum", params=params).sample(7, _gen(6))
    b = PriorDistribution(id="pendulum", params=dict(reversed(params.items()))).sample(7, _gen(6))
    assert sorted(a) == ["gravity", "length", "mass"] and all(v.shape == (7,) for v in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    collection = EnvCollection(members={"pendulum": "Pendulum-v1"}, structure=PriorDistribution(id="pendulum",
                                                                                                 params=params))
    assert all(torch.equal(v, a[k]) for k, v in collection.sample_params(7, _gen(6)).items())
    assert collection.draw(None, 3, _gen()) == ("pendulum",) * 3


def test_the_hand_computed_chi_square_bound_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 10):
        exact = float(scipy_stats.chi2.ppf(1 - ALPHA, df))
        assert abs(wilson_hilferty(df, ALPHA) - exact) / exact < 0.02, df


