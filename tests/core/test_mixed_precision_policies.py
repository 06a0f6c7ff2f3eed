"""Policies under autocast (``PPOConfig.compute_dtype="bfloat16"``): what a mixed-precision update reads."""

from __future__ import annotations

import pytest
import torch

from core.layout import LOG_PROB, NEXT, SHARED, STATE_VALUE
from core.policies import PolicyConfig, make_policies
from core.specs import rand
from tests.core.test_policies import TREES, _gen


@pytest.mark.parametrize("name", ["bounded_tanh", "box_discrete", "composite_discrete_box"])
def test_a_bfloat16_evaluation_reads_stored_actions_and_values_at_float32_precision(name):
    """Under autocast (``PPOConfig.compute_dtype="bfloat16"``) the output layers stay float32: at unchanged
    weights a stored action's log-probability moves only by the trunk's rounding. A bfloat16 tanh-Gaussian mean
    (and the action rounded to it) had moved some by several nats, far beyond PPO's clip range."""
    tree = TREES[name]
    torch.manual_seed(0)
    policy = make_policies(tree, PolicyConfig(actor_output_gain=3.0, critic_output_gain=10.0))["agents"]
    step = rand(tree, (2048,), _gen(1))
    obs, shared = step["agents"], step.get(SHARED, None)
    out = policy.act(obs, shared, _gen(2))  # acting: float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ev = policy.evaluate_terms(obs.copy().update(out.exclude(NEXT)), shared)
    assert ev[LOG_PROB].dtype == ev[STATE_VALUE].dtype == torch.float32
    assert (ev[LOG_PROB] - out[LOG_PROB]).abs().max() < 0.1
    scale = out[STATE_VALUE].abs().max()  # values of about 10: the trunk's rounding moves them by a few hundredths
    assert scale > 5 and torch.allclose(ev[STATE_VALUE], out[STATE_VALUE], rtol=0.02, atol=0.02 * float(scale))
