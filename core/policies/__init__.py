"""Policies built from the spec tree: distribution heads, group actor-critics, export for deployment.

Hot path (every env step): :meth:`GroupPolicy.act` / :meth:`GroupPolicy.act_step` on tensors with a
hand-written Gumbel-max sampler; training: :meth:`GroupPolicy.evaluate`; deployment: :func:`export_policy`.
"""

from core.policies.actor_critic import ENTROPY, GroupPolicy, make_policies
from core.policies.composite import ActionHeads
from core.policies.config import PolicyConfig
from core.policies.distributions import (BernoulliHead, CategoricalHead, GaussianHead, Head, MultiCategoricalHead,
                                         TanhGaussianHead, gumbel_argmax, make_head)
from core.policies.export import DeployablePolicy, deployable, deployment_inputs, export_policy
from core.policies.networks import ObservationEncoder, SharedEncoder, init_linear_, mlp

__all__ = [
    "ENTROPY", "ActionHeads", "BernoulliHead", "CategoricalHead", "DeployablePolicy", "GaussianHead",
    "GroupPolicy", "Head", "MultiCategoricalHead", "ObservationEncoder", "PolicyConfig", "SharedEncoder",
    "TanhGaussianHead", "deployable", "deployment_inputs", "export_policy", "gumbel_argmax", "init_linear_",
    "make_head", "make_policies", "mlp",
]
