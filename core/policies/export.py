"""The deployable policy: plain tensors in, the deterministic action out, exportable with ``torch.export``.

Inputs of :class:`DeployablePolicy`, all with batch ``[B, A]`` (``A`` = group capacity, fixed; ``B`` free)::

    *observation      one tensor per non-eval-only observation leaf, [B, A, *leaf.shape] in the leaf dtype,
                      in core.specs.iter_leaves order of the agent's observation node (``observation_keys``)
    action_mask=      optional [B, A, n] bool, for a single discrete / multi-discrete action leaf
    recurrent_state=  [B, A, H] (recurrent policies only)

Output: the action (masked argmax, Gaussian mean, squashed mean, ``logit > 0``): one tensor
``[B, A, *leaf.shape]`` for a bare action leaf, else a tuple in ``action_keys`` order; a recurrent policy
appends the next state ``[B, A, H]``. The same computation as ``GroupPolicy.act(..., deterministic=True)``.
Critic and eval-only leaves are not part of it (notes/tensordict-hot-paths.md section 5, pattern 10: no
``torch.distributions``, a masked argmax, a dynamic batch ``Dim``). Saving to disk belongs to orchestration
(``torch.export.save(program, path)``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from core.layout import ACTION_MASK, OBSERVATION, RECURRENT_STATE

from .actor_critic import GroupPolicy


class DeployablePolicy(nn.Module):
    """Actor-only view of a :class:`GroupPolicy` (shares its modules: later weight updates show through).

    Attributes:
        observation_keys: key path of each positional input (under the group's ``"observation"``).
        action_keys: key path of each action output (under ``"action"``).
        recurrent: whether ``recurrent_state`` is an input and the next state an output.
    """

    def __init__(self, policy: GroupPolicy) -> None:
        super().__init__()
        self.encoder, self.trunk, self.gru, self.out, self.heads = (
            policy.actor_encoder, policy.actor_trunk, policy.gru, policy.actor_out, policy.heads)
        self.register_buffer("agent_ids", policy.agent_ids if policy.config.agent_id_input else None,
                             persistent=False)
        self.observation_keys = list(policy.actor_encoder.paths)
        self.action_keys = list(policy.heads.paths)
        self.recurrent = policy.gru is not None

    def forward(self, *observation: Tensor, action_mask: Tensor | None = None,
                recurrent_state: Tensor | None = None):
        """See the module docstring for inputs and outputs."""
        x = self.encoder(observation)
        if self.agent_ids is not None:
            x = torch.cat([x, self.agent_ids.expand(*x.shape[:-1], self.agent_ids.shape[0])], -1)
        h = self.trunk(x)
        if self.gru is not None:
            lead = h.shape[:-1]
            recurrent_state = self.gru(h.reshape(-1, h.shape[-1]),
                                       recurrent_state.reshape(-1, recurrent_state.shape[-1])).reshape(*lead, -1)
            h = recurrent_state
        actions = self.heads.mode(self.out(h), action_mask)
        if self.recurrent:
            return (*actions, recurrent_state)
        return actions[0] if len(actions) == 1 else tuple(actions)


def deployable(policy: GroupPolicy) -> DeployablePolicy:
    """The tensor-in/action-out module of ``policy`` (module docstring)."""
    return DeployablePolicy(policy)


def deployment_inputs(policy: GroupPolicy, batch) -> tuple[tuple[Tensor, ...], dict[str, Tensor]]:
    """``(args, kwargs)`` for :class:`DeployablePolicy` from a group entry ``[B, A]`` (TensorDict or dict).

    ``kwargs`` holds ``action_mask`` when ``batch`` has one and, for a recurrent policy, ``recurrent_state``
    (zeros when ``batch`` has none).
    """
    args = tuple(policy.actor_encoder.read(batch[OBSERVATION]))
    kwargs = {}
    mask = batch.get(ACTION_MASK, None)
    if mask is not None:
        kwargs["action_mask"] = mask
    if policy.gru is not None:
        state = batch.get(RECURRENT_STATE, None)
        kwargs["recurrent_state"] = state if state is not None else policy.initial_state(args[0].shape[:1])
    return args, kwargs


def export_policy(policy: GroupPolicy, example_batch) -> ExportedProgram:
    """Exports :func:`deployable` ``(policy)`` with a dynamic batch dim (``Dim("batch")`` on dim 0).

    Args:
        policy: the policy (its current weights are captured).
        example_batch: a group entry ``[B, A]`` with ``"observation"`` and, if the program should take one,
            ``"action_mask"``. A batch of 1 is repeated to 2 rows first: tracing a size-1 dim would
            specialise it.

    Returns:
        The program; ``program.module()(*args, **kwargs)`` with :func:`deployment_inputs` gives the action.
    """
    args, kwargs = deployment_inputs(policy, example_batch)
    if args[0].shape[0] == 1:
        args = tuple(a.expand(2, *a.shape[1:]).clone() for a in args)
        kwargs = {k: v.expand(2, *v.shape[1:]).clone() for k, v in kwargs.items()}
    batch = Dim("batch", min=1)
    dynamic_shapes = {"observation": tuple({0: batch} for _ in args), **{k: {0: batch} for k in kwargs}}
    module = deployable(policy).eval()
    with torch.no_grad():
        return torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)


__all__ = ["DeployablePolicy", "deployable", "deployment_inputs", "export_policy"]
