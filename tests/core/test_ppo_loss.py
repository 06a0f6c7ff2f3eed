"""The PPO loss against hand computations, a plain-Python reference, its on-policy property and TorchRL."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tensordict import TensorDict

from core.losses import PPOConfig, ppo_loss
from core.losses.ppo import diagnostic_moments, diagnostics, merge_moments, moment_diagnostics

KEYS = ("loss_policy", "loss_value", "loss_entropy", "approx_kl", "clip_fraction", "entropy", "explained_variance")


def _inputs(lp_old, lp_new, adv, v_old, target, v_new, entropy, shape=None):
    t = (lambda xs: torch.tensor(xs, dtype=torch.float32).reshape(shape or (len(xs), 1)))
    behaviour = TensorDict(log_prob=t(lp_old), advantage=t(adv), state_value=t(v_old), value_target=t(target))
    current = TensorDict(log_prob=t(lp_new), state_value=t(v_new), entropy=t(entropy))
    return behaviour, current


def test_hand_computed_example():
    ratios = [1.0, 1.5, 0.5, 1.1]
    behaviour, current = _inputs(
        lp_old=[math.log(0.5)] * 4, lp_new=[math.log(0.5 * r) for r in ratios], adv=[1.0, 1.0, -1.0, -2.0],
        v_old=[0.0] * 4, target=[1.0, 2.0, 3.0, 5.0], v_new=[1.0, 2.0, 3.0, 4.0], entropy=[0.1, 0.2, 0.3, 0.4],
    )
    current = current.apply(lambda x: x.requires_grad_())
    cfg = PPOConfig(normalize_advantage=False, clip_eps=0.2, value_coef=0.5, entropy_coef=0.1)
    out = ppo_loss(behaviour, current, cfg)
    # min(r A, clip(r) A): 1, min(1.5, 1.2) = 1.2, min(-0.5, -0.8) = -0.8, -2.2 -> mean -0.2
    assert out["loss_policy"].item() == pytest.approx(0.2)
    assert out["loss_value"].item() == pytest.approx(0.5 * 0.5 * (0 + 0 + 0 + 1) / 4)
    assert out["loss_entropy"].item() == pytest.approx(-0.1 * 0.25)
    assert out["clip_fraction"].item() == pytest.approx(0.5)
    assert out["approx_kl"].item() == pytest.approx(sum((r - 1) - math.log(r) for r in ratios) / 4, rel=1e-5)
    assert out["entropy"].item() == pytest.approx(0.25)
    resid = [t - v for t, v in zip([1, 2, 3, 5], [1, 2, 3, 4])]
    assert out["explained_variance"].item() == pytest.approx(
        1 - statistics.pvariance(resid) / statistics.pvariance([1, 2, 3, 5]), rel=1e-5
    )
    # d loss_policy / d log pi = -A r / N where the unclipped branch is the minimum, else 0
    out["loss_policy"].backward()
    torch.testing.assert_close(current["log_prob"].grad.flatten(), torch.tensor([-0.25, 0.0, 0.0, 0.55]))
    assert all(not out[k].requires_grad for k in KEYS[3:])


def test_value_clipping_takes_the_larger_error():
    behaviour, current = _inputs(lp_old=[0.0] * 2, lp_new=[0.0] * 2, adv=[1.0, -1.0], v_old=[0.0, 0.0],
                                 target=[1.0, 1.0], v_new=[1.0, -0.2], entropy=[0.0, 0.0])
    out = ppo_loss(behaviour, current, PPOConfig(value_clip_eps=0.5, value_coef=1.0))
    # sample 0: err 0, clipped V = 0.5 -> 0.25; sample 1: err 1.44, clipped V = -0.2 -> 1.44
    assert out["loss_value"].item() == pytest.approx(0.5 * (0.25 + 1.44) / 2)


def reference(rows: list[dict], cfg: PPOConfig) -> dict:
    """Plain-Python PPO over the valid samples (the 37-details formulas, CleanRL's unbiased std)."""
    adv = [r["adv"] for r in rows]
    if cfg.normalize_advantage:
        mean = sum(adv) / len(adv)
        std = statistics.stdev(adv) if len(adv) > 1 else 0.0
        adv = [(a - mean) / (std + cfg.advantage_eps) for a in adv]
    surr, verr, kl, clipped = [], [], [], []
    for r, a in zip(rows, adv):
        ratio = math.exp(r["lp_new"] - r["lp_old"])
        lo, hi = 1 - cfg.clip_eps, 1 + cfg.clip_eps
        surr.append(min(ratio * a, min(max(ratio, lo), hi) * a))
        err = (r["v_new"] - r["target"]) ** 2
        if cfg.value_clip_eps is not None:
            v_c = r["v_old"] + min(max(r["v_new"] - r["v_old"], -cfg.value_clip_eps), cfg.value_clip_eps)
            err = max(err, (v_c - r["target"]) ** 2)
        verr.append(err)
        kl.append((ratio - 1) - math.log(ratio))
        clipped.append(float(abs(ratio - 1) > cfg.clip_eps))
    n = len(rows)
    targets = [r["target"] for r in rows]
    var_t = statistics.pvariance(targets)
    resid = statistics.pvariance([r["target"] - r["v_new"] for r in rows])
    return dict(
        loss_policy=-sum(surr) / n, loss_value=0.5 * cfg.value_coef * sum(verr) / n,
        loss_entropy=-cfg.entropy_coef * sum(r["ent"] for r in rows) / n, approx_kl=sum(kl) / n,
        clip_fraction=sum(clipped) / n, entropy=sum(r["ent"] for r in rows) / n,
        explained_variance=1 - resid / var_t if var_t > 0 else math.nan,
    )


@st.composite
def minibatches(draw, max_n: int = 12, max_agents: int = 3):
    n, a = draw(st.integers(1, max_n), label="N"), draw(st.integers(1, max_agents), label="A")
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1), label="seed"))
    shape = (n, a, 1)
    lp_old = -torch.rand(shape, generator=g) * 2
    behaviour = TensorDict(log_prob=lp_old, advantage=torch.randn(shape, generator=g) * 2,
                           state_value=torch.randn(shape, generator=g), value_target=torch.randn(shape, generator=g))
    current = TensorDict(log_prob=lp_old + 0.4 * torch.randn(shape, generator=g),
                         state_value=torch.randn(shape, generator=g), entropy=torch.rand(shape, generator=g))
    mask = torch.rand((n, a), generator=g) < 0.7
    mask.view(-1)[draw(st.integers(0, n * a - 1), label="one_valid")] = True
    return behaviour, current, mask


configs = st.builds(
    PPOConfig, normalize_advantage=st.booleans(), value_clip_eps=st.sampled_from([None, 0.3]),
    entropy_coef=st.sampled_from([0.0, 0.01]), clip_eps=st.sampled_from([0.1, 0.2]),
)


@given(mb=minibatches(), cfg=configs)
def test_masked_loss_matches_python_reference_over_valid_entries(mb, cfg):
    behaviour, current, mask = mb
    out = ppo_loss(behaviour, current, cfg, mask)
    rows = [dict(lp_old=float(behaviour["log_prob"][i, j]), adv=float(behaviour["advantage"][i, j]),
                 v_old=float(behaviour["state_value"][i, j]), target=float(behaviour["value_target"][i, j]),
                 lp_new=float(current["log_prob"][i, j]), v_new=float(current["state_value"][i, j]),
                 ent=float(current["entropy"][i, j])) for i, j in mask.nonzero().tolist()]
    ref = reference(rows, cfg)
    for k in KEYS:
        assert out[k].item() == pytest.approx(ref[k], rel=1e-4, abs=1e-5, nan_ok=True), k


@given(mb=minibatches(), cfg=configs)
def test_masked_entries_change_neither_loss_nor_gradients(mb, cfg):
    behaviour, current, mask = mb
    absent = ~mask.unsqueeze(-1)
    poisoned_b = behaviour.apply(lambda x: x.masked_fill(absent, math.nan))
    poisoned_c = current.apply(lambda x: x.masked_fill(absent, 1e6))
    results = []
    for b, c in ((behaviour, current), (poisoned_b, poisoned_c)):
        c = c.apply(lambda x: x.clone().requires_grad_())
        out = ppo_loss(b, c, cfg, mask)
        sum(out[k] for k in ("loss_policy", "loss_value", "loss_entropy")).backward()
        results.append((out, c.apply(lambda x: x.grad, batch_size=c.batch_size)))
    (out, grads), (out_p, grads_p) = results
    for k in KEYS:
        torch.testing.assert_close(out_p[k], out[k], equal_nan=True)
    for k in ("log_prob", "state_value"):
        torch.testing.assert_close(grads_p[k], grads[k])
        assert torch.all(grads[k][absent] == 0)


@given(mb=minibatches(), normalize=st.booleans())
def test_on_policy_no_clipping_no_kl_and_minus_mean_advantage(mb, normalize):
    behaviour, current, _ = mb
    current = current.clone()
    current["log_prob"] = behaviour["log_prob"].clone()
    out = ppo_loss(behaviour, current, PPOConfig(normalize_advantage=normalize))
    adv = behaviour["advantage"]
    if normalize:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8) if adv.numel() > 1 else torch.zeros_like(adv)
    assert out["clip_fraction"].item() == 0.0
    assert out["approx_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert out["loss_policy"].item() == pytest.approx(-adv.mean().item(), abs=1e-5)


def test_shapes_are_checked_not_broadcast():
    behaviour, current = _inputs([0.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0] * 4,
                                 shape=(2, 2, 1))
    current["entropy"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"current\['entropy'\].*\[2, 2, 1\].*\[2, 2\]"):
        ppo_loss(behaviour, current, PPOConfig())
    current["entropy"] = torch.zeros(2, 2, 1)
    with pytest.raises(ValueError, match="mask"):
        ppo_loss(behaviour, current, PPOConfig(), mask=torch.ones(2, 2, 1, dtype=torch.bool))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="clip_eps"):
        PPOConfig(clip_eps=1.5)
    with pytest.raises(ValueError, match="minibatch_size"):
        PPOConfig(minibatch_size=0)
    with pytest.raises(ValueError, match="value_coef"):
        PPOConfig(value_coef=math.inf)
    with pytest.raises(TypeError):
        PPOConfig(0.2)  # kw_only
    with pytest.raises(AttributeError):
        PPOConfig().clip_eps = 0.3  # frozen


def test_matches_torchrl_clip_ppo_loss():
    """TorchRL's ClipPPOLoss as an oracle (l2 critic loss = (V - target)^2, so critic_coeff = value_coef / 2)."""
    from tensordict.nn import TensorDictModule
    from torchrl.modules import ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    g = torch.Generator().manual_seed(0)
    n, cfg = 32, PPOConfig(normalize_advantage=False, entropy_coef=0.01, value_coef=0.5, value_clip_eps=0.2)
    torch.manual_seed(0)
    net, critic_net = torch.nn.Linear(3, 4), torch.nn.Linear(3, 1)
    obs, action = torch.randn(n, 3, generator=g), torch.randint(0, 4, (n,), generator=g)
    with torch.no_grad():
        old_lp = torch.distributions.Categorical(logits=net(obs)).log_prob(action) + 0.3 * torch.randn(n, generator=g)
    adv, target, old_v = (torch.randn(n, 1, generator=g) for _ in range(3))

    actor = ProbabilisticActor(TensorDictModule(net, ["observation"], ["logits"]), in_keys=["logits"],
                               distribution_class=torch.distributions.Categorical, return_log_prob=True)
    oracle = ClipPPOLoss(actor, ValueOperator(critic_net, in_keys=["observation"]), clip_epsilon=cfg.clip_eps,
                         entropy_coeff=cfg.entropy_coef, critic_coeff=cfg.value_coef / 2, loss_critic_type="l2",
                         normalize_advantage=False, clip_value=cfg.value_clip_eps)
    expected = oracle(TensorDict(observation=obs, action=action, action_log_prob=old_lp, advantage=adv,
                                 value_target=target, state_value=old_v, batch_size=[n]))

    dist = torch.distributions.Categorical(logits=net(obs))
    behaviour = TensorDict(log_prob=old_lp.unsqueeze(-1), advantage=adv, state_value=old_v, value_target=target)
    current = TensorDict(log_prob=dist.log_prob(action).unsqueeze(-1), state_value=critic_net(obs),
                         entropy=dist.entropy().unsqueeze(-1))
    out = ppo_loss(behaviour, current, cfg)
    for ours, theirs in (("loss_policy", "loss_objective"), ("loss_value", "loss_critic"),
                         ("loss_entropy", "loss_entropy"), ("clip_fraction", "clip_fraction"), ("entropy", "entropy")):
        torch.testing.assert_close(out[ours], expected[theirs].reshape(()), msg=ours)


@given(seed=st.integers(0, 2**31 - 1), parts=st.lists(st.integers(1, 9), min_size=1, max_size=5),
       masked=st.booleans(), constant_target=st.booleans())
def test_diagnostics_merged_over_parts_equal_those_of_the_whole(seed, parts, masked, constant_target):
    """PPO's update reduces each epoch to moments and merges them: the same diagnostics as over all entries."""
    g = torch.Generator().manual_seed(seed)
    n, cfg = sum(parts), PPOConfig()

    def draw(scale=1.0):
        return torch.randn(n, 2, 1, generator=g) * scale

    log_ratio, value, entropy = draw(0.3), draw(), draw().abs()
    target = torch.full((n, 2, 1), 0.1) if constant_target else draw(50.0) + 100.0  # large mean: cancellation
    mask = torch.rand(n, 2, generator=g) < 0.7 if masked else None
    whole = torch.stack(diagnostics(log_ratio, value, target, entropy, mask, cfg))
    chunks = zip(*(x.split(parts) if x is not None else [None] * len(parts)
                   for x in (log_ratio, value, target, entropy, mask)))
    merged = merge_moments(torch.stack([diagnostic_moments(*chunk, cfg) for chunk in chunks]))
    got = moment_diagnostics(merged)
    torch.testing.assert_close(got[:3], whole[:3], rtol=1e-5, atol=1e-6)
    if constant_target:  # no variance to explain (a float32 pass over the whole saw its own rounding instead)
        assert bool(got[3].isnan()) and bool(whole[3].isnan())
    else:
        torch.testing.assert_close(got[3], whole[3], rtol=1e-4, atol=1e-5, equal_nan=True)


def test_a_ppo_config_value_of_another_kind_is_named_by_its_field():
    """``PPOConfig(clip_eps="0.2")`` raised "'<' not supported between 'float' and 'str'"; a string for a bool was
    taken (any non-empty string is true)."""
    import numpy as np

    from core.losses import PPOConfig

    with pytest.raises(TypeError, match=r"PPOConfig\.clip_eps takes a float, got '0\.2'"):
        PPOConfig(clip_eps="0.2")
    with pytest.raises(TypeError, match=r"PPOConfig\.normalize_advantage takes a bool, got 'false'"):
        PPOConfig(normalize_advantage="false")
    with pytest.raises(TypeError, match=r"PPOConfig\.target_kl takes a float or None, got True"):
        PPOConfig(target_kl=True)
    assert PPOConfig(clip_eps=np.float32(0.1), gamma=1, normalize_advantage=np.bool_(False)).gamma == 1
