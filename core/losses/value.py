"""The value loss of a critic trained on its own (a team critic): PPO's (clipped) value term, masked.

The same formula as the value term of :func:`core.losses.ppo.ppo_loss` (Schulman et al. 2017,
arXiv:1707.06347; "The 37 Implementation Details of PPO", detail 9,
https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/), without the ``value_coef`` weight:
a critic with an optimizer of its own has no other term to balance it against.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict


def value_loss(value: torch.Tensor, old_value: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None,
               clip_eps: float | None) -> TensorDict:
    """``loss_value`` and the detached ``explained_variance`` of one minibatch.

    With ``<.>`` the masked mean over present entries (``sum(x * m) / max(sum(m), 1)``)::

        loss_value = 0.5 * < (V - V_target)^2 >
                     with clip_eps: 0.5 * < max((V - V_t)^2, (V_old + clip(V - V_old, +-clip_eps) - V_t)^2) >
        explained_variance = 1 - Var[V_target - V] / Var[V_target]   (NaN if Var[V_target] == 0)

    Args:
        value: ``V(s)`` of the critic being trained, ``[N, A, 1]`` (any shape ending in 1), with gradients.
        old_value: ``V_old(s)``, the values the targets were computed with, same shape.
        target: the value targets (GAE returns), same shape.
        mask: bool, ``value``'s shape without the trailing 1, True where the agent is present; None: all.
            Absent entries (NaN included) change neither the loss nor its gradients.
        clip_eps: PPO2 value clipping around ``old_value``; None disables it.

    Returns:
        A TensorDict with batch ``[]``: ``loss_value`` (with gradients) and ``explained_variance`` (detached).

    Raises:
        ValueError: shapes that differ, or a mask that does not fit them.
    """
    shape = value.shape
    if value.ndim < 2 or shape[-1] != 1 or old_value.shape != shape or target.shape != shape:
        raise ValueError(f"value, old_value and target must share one shape [N, ..., 1]; got {list(shape)}, "
                         f"{list(old_value.shape)} and {list(target.shape)}")
    if mask is not None and (mask.shape != shape[:-1] or mask.dtype != torch.bool):
        raise ValueError(f"mask: expected bool {list(shape[:-1])}, got {mask.dtype} {list(mask.shape)}")
    valid = torch.ones(shape, dtype=torch.bool, device=value.device) if mask is None else mask.unsqueeze(-1)
    old_value, target = (torch.where(valid, x, 0.0) for x in (old_value, target))
    err = (value - target).square()
    if clip_eps is not None:
        clipped = old_value + (value - old_value).clamp(-clip_eps, clip_eps)
        err = torch.maximum(err, (clipped - target).square())
    loss = 0.5 * torch.where(valid, err, 0.0).sum() / valid.sum().clamp_min(1)
    with torch.no_grad():
        count = valid.sum().clamp_min(1)

        def mean(x: torch.Tensor) -> torch.Tensor:
            return torch.where(valid, x, 0.0).sum() / count

        residual = target - value.detach()
        var_target = mean((target - mean(target)).square())
        ev = torch.where(var_target > 0, 1.0 - mean((residual - mean(residual)).square()) / var_target, torch.nan)
    return TensorDict(loss_value=loss, explained_variance=ev)


__all__ = ["value_loss"]
