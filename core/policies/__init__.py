"""Policies built from the spec tree: distribution heads, group actor-critics, export for deployment.

Hot path (every env step): :meth:`GroupPolicy.act` / :meth:`GroupPolicy.act_step` on tensors with a
hand-written Gumbel-max sampler; training: :meth:`GroupPolicy.evaluate`; deployment: :func:`export_policy`.

The config record is imported at once and the rest on first use (PEP 562 ``__getattr__``): ``PolicyConfig`` is
torch-free, so ``orchestration.config`` (and ``shoal --help``) import it without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from core.policies.config import PolicyConfig

if TYPE_CHECKING:
    from core.policies.actor_critic import ENTROPY, GroupPolicy, make_policies
    from core.policies.composite import ActionHeads
    from core.policies.distributions import (BernoulliHead, CategoricalHead, GaussianHead, Head,
                                             MultiCategoricalHead, TanhGaussianHead, gumbel_argmax, make_head)
    from core.policies.export import DeployablePolicy, deployable, deployment_inputs, export_policy
    from core.policies.networks import ObservationEncoder, SharedEncoder, init_linear_, mlp
    from core.policies.reward_scaling import RewardScaler, discounted_returns, merge_moments, with_scaled_rewards

_LAZY = {
    **dict.fromkeys(("ENTROPY", "GroupPolicy", "make_policies"), "actor_critic"),
    "ActionHeads": "composite",
    **dict.fromkeys(("BernoulliHead", "CategoricalHead", "GaussianHead", "Head", "MultiCategoricalHead",
                     "TanhGaussianHead", "gumbel_argmax", "make_head"), "distributions"),
    **dict.fromkeys(("DeployablePolicy", "deployable", "deployment_inputs", "export_policy"), "export"),
    **dict.fromkeys(("ObservationEncoder", "SharedEncoder", "init_linear_", "mlp"), "networks"),
    **dict.fromkeys(("RewardScaler", "discounted_returns", "merge_moments", "with_scaled_rewards"), "reward_scaling"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ENTROPY", "ActionHeads", "BernoulliHead", "CategoricalHead", "DeployablePolicy", "GaussianHead",
    "GroupPolicy", "Head", "MultiCategoricalHead", "ObservationEncoder", "PolicyConfig", "RewardScaler",
    "SharedEncoder", "TanhGaussianHead", "deployable", "deployment_inputs", "discounted_returns", "export_policy",
    "gumbel_argmax", "init_linear_", "make_head", "make_policies", "merge_moments", "mlp", "with_scaled_rewards",
]
