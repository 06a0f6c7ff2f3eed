"""Action heads against torch.distributions: sampling frequencies, log_prob, entropy, mode, masks, shapes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import distributions as D

from core.policies import (BernoulliHead, CategoricalHead, GaussianHead, MultiCategoricalHead, TanhGaussianHead,
                           gumbel_argmax, make_head)
from core.specs import Leaf

BATCHES = [(), (3,), (2, 4)]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _chi2_limit(df: int) -> float:
    """Far beyond the 1e-9 quantile of chi2(df) (df + 10 sd + 10): a correct sampler never fails it."""
    return df + 10.0 * math.sqrt(2.0 * df) + 10.0


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# ------------------------------------------------------------------------------------- sampler frequencies
def test_gumbel_max_matches_categorical_frequencies():
    logits = torch.tensor([1.0, 0.5, -1.0, 2.0, 0.0, -3.0])
    n = 200_000
    ours = gumbel_argmax(logits.expand(n, -1), _gen(1))
    counts = torch.bincount(ours, minlength=6).double()
    assert _chi2(counts, D.Categorical(logits=logits).probs.double()) < _chi2_limit(5)
    # two-sample homogeneity against torch's own sampler (global RNG, forked so nothing leaks)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        ref = torch.bincount(D.Categorical(logits=logits).sample((n,)), minlength=6).double()
    pooled = (counts + ref) / (2 * n)
    stat = _chi2(counts, pooled) + _chi2(ref, pooled)
    assert stat < _chi2_limit(5)
    # a wrong sampler (uniform) fails the same test by far: the test can fail
    assert _chi2(torch.full((6,), n / 6.0), D.Categorical(logits=logits).probs.double()) > _chi2_limit(5)


def test_masked_categorical_frequencies_and_legality():
    leaf = Leaf.discrete(5, start=2)
    head = CategoricalHead(leaf)
    logits = torch.tensor([0.3, -0.2, 1.5, 0.0, -1.0])
    mask = torch.tensor([True, False, True, True, False])
    n = 100_000
    action, log_prob = head.sample(logits.expand(n, -1), _gen(3), mask.expand(n, -1))
    index = action - 2
    assert bool(mask[index].all())
    probs = torch.softmax(logits.masked_fill(~mask, -math.inf), -1).double()
    assert _chi2(torch.bincount(index, minlength=5).double(), probs) < _chi2_limit(2)
    torch.testing.assert_close(log_prob.squeeze(-1), probs.log().float()[index])


def test_multi_categorical_frequencies_per_component():
    leaf = Leaf.multi_discrete((3, 2, 4))
    head = MultiCategoricalHead(leaf)
    params = torch.randn(9, generator=_gen(4))
    n = 100_000
    action, _ = head.sample(params.expand(n, -1), _gen(5))
    for k, part in enumerate(params.split([3, 2, 4])):
        counts = torch.bincount(action[:, k], minlength=leaf.nvec[k]).double()
        assert counts.numel() == leaf.nvec[k]  # padding never sampled
        assert _chi2(counts, torch.softmax(part, -1).double()) < _chi2_limit(leaf.nvec[k] - 1)


def test_bernoulli_and_gaussian_moments():
    n = 100_000
    bern = BernoulliHead(Leaf.binary(3))
    logits = torch.tensor([-1.0, 0.0, 2.0])
    bits, _ = bern.sample(logits.expand(n, -1), _gen(6))
    assert bits.dtype == torch.int8
    torch.testing.assert_close(bits.float().mean(0), torch.sigmoid(logits), atol=0.01, rtol=0)

    gauss = GaussianHead(Leaf.box((2,)), log_std_init=math.log(0.5))
    mean = torch.tensor([1.0, -2.0])
    a, _ = gauss.sample(mean.expand(n, -1), _gen(7))
    torch.testing.assert_close(a.mean(0), mean, atol=0.01, rtol=0)
    torch.testing.assert_close(a.std(0), torch.full((2,), 0.5), atol=0.01, rtol=0)


def test_tanh_gaussian_stays_in_bounds_and_matches_pre_squash_moments():
    leaf = Leaf.box((2,), low=(-1.0, 0.0), high=(3.0, 0.5))
    head = TanhGaussianHead(leaf, log_std_init=0.0)
    mean = torch.tensor([0.2, -0.3])
    a, _ = head.sample(mean.expand(100_000, -1), _gen(8))
    low, high = torch.tensor([-1.0, 0.0]), torch.tensor([3.0, 0.5])
    assert bool(((a >= low) & (a <= high)).all())
    u = torch.atanh(((a - (low + high) / 2) / ((high - low) / 2)).clamp(-1 + 1e-6, 1 - 1e-6))
    torch.testing.assert_close(u.mean(0), mean, atol=0.02, rtol=0)


# -------------------------------------------------------------------------- log_prob / entropy vs torch
@pytest.mark.parametrize("batch", BATCHES)
def test_categorical_log_prob_entropy_match_torch(batch):
    g = _gen(10)
    head = CategoricalHead(Leaf.discrete(6))
    logits = torch.randn(*batch, 6, generator=g)
    mask = torch.rand(*batch, 6, generator=g) < 0.6
    mask[..., 0] = True  # at least one legal action per row
    reference = D.Categorical(probs=torch.softmax(logits, -1) * mask)  # renormalised legal probabilities
    action, log_prob = head.sample(logits, g, mask)
    assert action.shape == batch and log_prob.shape == (*batch, 1)
    torch.testing.assert_close(log_prob, reference.log_prob(action).unsqueeze(-1))
    torch.testing.assert_close(head.log_prob(logits, action, mask), log_prob)
    torch.testing.assert_close(head.entropy(logits, mask), reference.entropy().unsqueeze(-1))
    torch.testing.assert_close(head.entropy(logits), D.Categorical(logits=logits).entropy().unsqueeze(-1))
    assert torch.equal(head.mode(logits, mask), (torch.softmax(logits, -1) * mask).argmax(-1))


@pytest.mark.parametrize("batch", BATCHES)
def test_multi_categorical_log_prob_entropy_match_torch(batch):
    g = _gen(11)
    nvec = (3, 5, 2)
    head = MultiCategoricalHead(Leaf.multi_discrete(nvec))
    params = torch.randn(*batch, sum(nvec), generator=g)
    mask = torch.rand(*batch, sum(nvec), generator=g) < 0.7
    for start in (0, 3, 8):
        mask[..., start] = True
    action, log_prob = head.sample(params, g, mask)
    assert action.shape == (*batch, 3) and log_prob.shape == (*batch, 1)
    dists = [D.Categorical(probs=torch.softmax(p, -1) * m)
             for p, m in zip(params.split(nvec, -1), mask.split(nvec, -1))]
    ref_lp = sum(d.log_prob(action[..., k]) for k, d in enumerate(dists)).unsqueeze(-1)
    torch.testing.assert_close(log_prob, ref_lp)
    torch.testing.assert_close(head.log_prob(params, action, mask), ref_lp)
    torch.testing.assert_close(head.entropy(params, mask), sum(d.entropy() for d in dists).unsqueeze(-1))
    mode = head.mode(params, mask)
    assert torch.equal(mode, torch.stack([d.probs.argmax(-1) for d in dists], -1))


@pytest.mark.parametrize("batch", BATCHES)
def test_bernoulli_log_prob_entropy_match_torch(batch):
    g = _gen(12)
    head = BernoulliHead(Leaf.binary(4))
    logits = torch.randn(*batch, 4, generator=g) * 3
    action, log_prob = head.sample(logits, g)
    ref = D.Independent(D.Bernoulli(logits=logits), 1)
    torch.testing.assert_close(log_prob, ref.log_prob(action.float()).unsqueeze(-1))
    torch.testing.assert_close(head.entropy(logits), ref.entropy().unsqueeze(-1))
    assert torch.equal(head.mode(logits), (logits > 0).to(torch.int8))


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_gaussian_log_prob_entropy_match_torch(batch, shape):
    g = _gen(13)
    head = GaussianHead(Leaf.box(shape), log_std_init=-0.5)
    d = math.prod(shape)
    with torch.no_grad():
        head.log_std.copy_(torch.randn(d, generator=g) * 0.3)
    mean = torch.randn(*batch, d, generator=g)
    action, log_prob = head.sample(mean, g)
    assert action.shape == (*batch, *shape) and log_prob.shape == (*batch, 1)
    ref = D.Independent(D.Normal(mean, head.log_std.exp()), 1)
    flat = action.reshape((*batch, d))
    torch.testing.assert_close(log_prob, ref.log_prob(flat).unsqueeze(-1))
    torch.testing.assert_close(head.log_prob(mean, action), log_prob)
    torch.testing.assert_close(head.entropy(mean), ref.entropy().unsqueeze(-1).expand(*batch, 1))
    assert torch.equal(head.mode(mean), mean.reshape((*batch, *shape)))


@pytest.mark.parametrize("batch", BATCHES)
def test_tanh_gaussian_log_prob_matches_torch_transformed(batch):
    g = _gen(14)
    low, high = torch.tensor([-2.0, 0.0, 1.0]), torch.tensor([2.0, 1.0, 5.0])
    head = TanhGaussianHead(Leaf.box((3,), low=low, high=high), log_std_init=-0.3)
    mean = torch.randn(*batch, 3, generator=g)
    action, log_prob = head.sample(mean, g)
    base = D.Normal(mean, head.log_std.exp())
    ref = D.Independent(D.TransformedDistribution(
        base, [D.TanhTransform(), D.AffineTransform((low + high) / 2, (high - low) / 2)]), 1)
    torch.testing.assert_close(log_prob, ref.log_prob(action).unsqueeze(-1), atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(head.log_prob(mean, action), log_prob)  # same path: exact
    torch.testing.assert_close(head.entropy(mean), D.Independent(base, 1).entropy().unsqueeze(-1))
    torch.testing.assert_close(head.mode(mean), (low + high) / 2 + (high - low) / 2 * torch.tanh(mean))


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 7), rows=st.integers(1, 5))
def test_all_masked_row_stays_finite(seed, n, rows):
    """A padded (absent) agent may have no legal action: values stay finite instead of NaN."""
    g = _gen(seed)
    head = CategoricalHead(Leaf.discrete(n))
    logits = torch.randn(rows, n, generator=g, requires_grad=True)
    mask = torch.zeros(rows, n, dtype=torch.bool)
    action, log_prob = head.sample(logits, g, mask)
    entropy = head.entropy(logits, mask)
    assert bool(torch.isfinite(log_prob).all() and torch.isfinite(entropy).all())
    (log_prob.sum() + entropy.sum()).backward()
    assert bool(torch.isfinite(logits.grad).all())


def test_masked_logits_get_no_gradient_and_log_prob_is_differentiable():
    head = CategoricalHead(Leaf.discrete(4))
    logits = torch.randn(5, 4, generator=_gen(15), requires_grad=True)
    mask = torch.tensor([True, True, False, True]).expand(5, -1)
    action, _ = head.sample(logits.detach(), _gen(16), mask)
    (head.log_prob(logits, action, mask).sum() + head.entropy(logits, mask).sum()).backward()
    assert bool((logits.grad[:, 2] == 0).all()) and bool((logits.grad[:, [0, 1, 3]] != 0).any())


def test_make_head_picks_by_leaf_kind():
    assert isinstance(make_head(Leaf.discrete(3)), CategoricalHead)
    assert isinstance(make_head(Leaf.multi_discrete((2, 2))), MultiCategoricalHead)
    assert isinstance(make_head(Leaf.binary(2)), BernoulliHead)
    assert type(make_head(Leaf.box((2,)))) is GaussianHead
    assert type(make_head(Leaf.box((2,), low=0.0))) is GaussianHead  # half-bounded: plain Gaussian
    assert isinstance(make_head(Leaf.box((2,), low=-1, high=1)), TanhGaussianHead)
    assert type(make_head(Leaf.box((2,), low=-1, high=1), squash_bounded=False)) is GaussianHead
    with pytest.raises(ValueError, match="float dtype"):
        make_head(Leaf.box((2,), dtype=torch.int64))
    with pytest.raises(ValueError, match="no action mask"):
        GaussianHead(Leaf.box((2,))).log_prob(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool))


def test_same_generator_seed_same_samples():
    head = CategoricalHead(Leaf.discrete(7))
    logits = torch.randn(100, 7, generator=_gen(17))
    a1, _ = head.sample(logits, _gen(42))
    a2, _ = head.sample(logits, _gen(42))
    a3, _ = head.sample(logits, _gen(43))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)


def test_masked_sampling_never_picks_an_illegal_action_even_with_infinite_noise(monkeypatch):
    # Exponential noise of exactly 0 (log -> -inf, an infinitely large Gumbel draw) on every entry: the mask
    # applied after the noise must still exclude illegal actions.
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, generator=None: self.zero_())
    logits = torch.tensor([[5.0, 0.0, -1.0], [0.0, 3.0, 1.0]])
    mask = torch.tensor([[False, True, True], [True, False, False]])
    index = gumbel_argmax(logits, _gen(), mask)
    assert mask.gather(-1, index.unsqueeze(-1)).all()


def test_a_known_all_true_mask_skips_masking_and_a_copy_of_it_is_still_applied():
    from core.layout import all_true, is_all_true

    head = CategoricalHead(Leaf.discrete(3))
    logits = torch.tensor([[0.2, -0.4, 1.0]])
    marked = all_true(1, 3)
    assert is_all_true(marked) and not is_all_true(marked.clone()) and not is_all_true(torch.ones(1, 3).bool())
    assert torch.equal(head.log_prob(logits, torch.tensor([2]), marked), head.log_prob(logits, torch.tensor([2])))
    partial = marked.clone()
    partial[0, 2] = False  # an unmarked mask is applied
    assert head.log_prob(logits, torch.tensor([2]), partial).item() < -1e30


@pytest.mark.parametrize("shape", [(3, 2), (1024, 1, 2), (600, 3, 5), (64, 40)])
def test_log_softmax_matches_torch_values_and_gradients(shape):
    """The transposed path (large batches of few actions) and the direct one give torch's log_softmax."""
    from core.policies.distributions import log_softmax

    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    x[..., 0] = torch.finfo(x.dtype).min  # a masked action, as _masked writes it
    x.requires_grad_(True)
    ours, ref = log_softmax(x), x.log_softmax(-1)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    (g_ours,), (g_ref,) = (torch.autograd.grad((y.clamp_min(-1e4) * weights).sum(), x) for y in (ours, ref))
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(3, 2), (1024, 1, 2), (600, 3, 5)])
def test_log_prob_and_entropy_at_match_torch(shape):
    """Both paths of log_prob_at / log_prob_entropy_at give Categorical's log_prob and entropy."""
    from core.policies.distributions import log_prob_at, log_prob_entropy_at

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, generator=gen) * 3
    index = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    dist = D.Categorical(logits=logits)
    torch.testing.assert_close(log_prob_at(logits, index), dist.log_prob(index).unsqueeze(-1))
    lp, ent = log_prob_entropy_at(logits, index)
    torch.testing.assert_close(lp, dist.log_prob(index).unsqueeze(-1))
    torch.testing.assert_close(ent, dist.entropy().unsqueeze(-1))


@pytest.mark.parametrize("leaf", [Leaf.discrete(2), Leaf.discrete(5, start=1), Leaf.discrete(18), Leaf.discrete(32),
                                  Leaf.discrete(40), Leaf.multi_discrete((20, 20)), Leaf.multi_discrete((2, 5)),
                                  Leaf.binary(3)],
                         ids=["d2", "d5_start1", "d18", "d32", "d40", "md20x20", "md2x5", "binary3"])
@pytest.mark.parametrize("rows", [3, 1023, 2047])
def test_exact_heads_give_a_sampled_action_the_same_log_prob_bits_at_any_batch_size(leaf, rows):
    """Head.exact_log_prob: one step's rows and a fragment of several steps, across the sizes where a kernel that
    vectorises across rows would change its bits (transposed log-softmax at >= 2,048 values)."""
    head = make_head(leaf)
    assert head.exact_log_prob
    steps, g = 3, _gen(rows)
    params = torch.randn(rows, steps, head.num_params, generator=g) * 3
    per_step = [head.sample(params[:, t], g) for t in range(steps)]
    actions = torch.stack([a for a, _ in per_step], 1)
    assert torch.equal(head.log_prob(params, actions), torch.stack([lp for _, lp in per_step], 1))
