"""The behaviour-cloning loss against a plain-Python reference, with agent and action masks, and its contract."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.layout import ACTION, ACTION_MASK, ENTROPY, LOG_PROB, MASK, OBSERVATION
from core.losses.bc import BCConfig, bc_loss
from core.policies import PolicyConfig, make_policies
from core.specs import ArrayPopulation, AgentNode, Leaf


def _reference(log_prob: list[list[float]], entropy: list[list[float]], mask: list[list[bool]] | None,
               coef: float) -> tuple[float, float, float]:
    """``(loss_bc, loss_entropy, entropy)`` by loops over (transition, agent) entries."""
    picked = [(lp, h) for n, row in enumerate(log_prob) for a, (lp, h) in enumerate(zip(row, entropy[n]))
              if mask is None or mask[n][a]]
    count = max(len(picked), 1)
    nll = -sum(lp for lp, _ in picked) / count
    mean_h = sum(h for _, h in picked) / count
    return nll, (-coef * mean_h if coef else 0.0), mean_h


@given(data=st.data(), n=st.integers(1, 5), a=st.integers(1, 3), coef=st.sampled_from([0.0, 0.01, 0.5]),
       masked=st.booleans())
def test_matches_a_reference_loop(data, n, a, coef, masked):
    floats = st.floats(-5.0, 0.0, allow_nan=False, width=32)
    log_prob = data.draw(st.lists(st.lists(floats, min_size=a, max_size=a), min_size=n, max_size=n))
    entropy = data.draw(st.lists(st.lists(st.floats(0.0, 2.0, width=32), min_size=a, max_size=a),
                                 min_size=n, max_size=n))
    mask = data.draw(st.lists(st.lists(st.booleans(), min_size=a, max_size=a), min_size=n, max_size=n)) \
        if masked else None
    current = {LOG_PROB: torch.tensor(log_prob).unsqueeze(-1), ENTROPY: torch.tensor(entropy).unsqueeze(-1)}
    out = bc_loss(current, BCConfig(entropy_coef=coef), None if mask is None else torch.tensor(mask))
    nll, loss_h, mean_h = _reference(log_prob, entropy, mask, coef)
    assert out["loss_bc"].item() == pytest.approx(nll, abs=1e-5)
    assert out["loss_entropy"].item() == pytest.approx(loss_h, abs=1e-5)
    assert out["perplexity"].item() == pytest.approx(math.exp(nll), rel=1e-5)
    assert out["entropy"].item() == pytest.approx(mean_h, abs=1e-5)


def test_masked_entries_change_neither_values_nor_gradients():
    mask = torch.tensor([[True, False], [False, True]])
    clean = torch.tensor([[-1.0, -0.5], [-0.25, -2.0]]).unsqueeze(-1)
    dirty = torch.where(mask.unsqueeze(-1), clean, torch.tensor([[[torch.nan], [-torch.inf]]]))
    results = []
    for x in (clean, dirty):
        x = x.clone().requires_grad_()
        out = bc_loss({LOG_PROB: x, ENTROPY: torch.zeros_like(x)}, BCConfig(), mask)
        out["loss_bc"].backward()
        results.append((out["loss_bc"].detach(), x.grad))
    assert results[0][0].item() == pytest.approx(1.5)
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    assert results[1][1][0, 1].item() == 0.0 and results[1][1][0, 0].item() == -0.5


def test_a_policy_that_always_plays_the_recorded_actions_has_zero_loss():
    zeros = torch.zeros(4, 2, 1)
    out = bc_loss({LOG_PROB: zeros}, BCConfig(), torch.zeros(4, 2, dtype=torch.bool))  # all masked too
    assert out["loss_bc"].item() == 0.0 and out["perplexity"].item() == 1.0 and math.isnan(out["entropy"].item())
    assert not out["perplexity"].requires_grad


def test_policy_log_probs_respect_action_masks_differentially():
    """The chain a BC learner runs (policy heads on recorded actions under recorded action masks, then the
    loss) against logits masked by hand: log-softmax over the legal actions only, mean over present agents."""
    torch.manual_seed(0)
    tree = ArrayPopulation(template=AgentNode(observation=Leaf.box((3,)), action=Leaf.discrete(4)), capacity=3)
    policy = next(iter(make_policies(tree, PolicyConfig(hidden_sizes=(8,), actor_output_gain=1.0)).values()))
    g = torch.Generator().manual_seed(1)
    n, a = 6, 3
    action_mask = torch.rand(n, a, 4, generator=g) < 0.6
    action_mask[..., 2] = True  # at least one legal action per entry
    legal = torch.multinomial(action_mask.reshape(-1, 4).float(), 1, generator=g).reshape(n, a)
    agent_mask = torch.rand(n, a, generator=g) < 0.7
    agent_mask[0, 0] = True
    batch = {OBSERVATION: torch.randn(n, a, 3, generator=g), ACTION: legal, ACTION_MASK: action_mask, MASK: agent_mask}
    terms = policy.evaluate_terms(batch)
    loss = bc_loss(terms, BCConfig(), agent_mask)["loss_bc"]
    grad = torch.autograd.grad(loss, policy.actor_out.weight)[0]

    params, _ = policy.actor_params(policy.actor_encoder.encode(batch[OBSERVATION]))
    total, count = 0.0, 0
    for i in range(n):
        for j in range(a):
            if not agent_mask[i, j]:
                continue
            logits = params[i, j].masked_fill(~action_mask[i, j], -torch.inf)
            total = total - torch.log_softmax(logits, -1)[legal[i, j]]
            count += 1
    reference = total / count
    ref_grad = torch.autograd.grad(reference, policy.actor_out.weight)[0]
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_shapes_are_checked():
    lp = torch.zeros(4, 2, 1)
    with pytest.raises(ValueError, match="log_prob"):
        bc_loss({LOG_PROB: torch.zeros(4)}, BCConfig())
    with pytest.raises(ValueError, match="entropy"):
        bc_loss({LOG_PROB: lp, ENTROPY: torch.zeros(4, 2)}, BCConfig())
    with pytest.raises(ValueError, match="mask"):
        bc_loss({LOG_PROB: lp}, BCConfig(), torch.ones(4, 2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="entropy_coef"):
        bc_loss({LOG_PROB: lp}, BCConfig(entropy_coef=0.1))


@pytest.mark.parametrize("field, value", [("lr", 0.0), ("lr", math.nan), ("minibatch_size", 0),
                                          ("max_grad_norm", -1.0), ("entropy_coef", math.inf)])
def test_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        BCConfig(**{field: value})
