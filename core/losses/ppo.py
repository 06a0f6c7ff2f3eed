"""The PPO loss on tensors: clipped surrogate, (clipped) value loss, entropy bonus, detached diagnostics.

Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv:1707.06347. Implementation choices
follow "The 37 Implementation Details of PPO" (Huang et al. 2022,
https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/), cited as "detail N" below.
The loss never touches a module or an optimizer: the caller evaluates the policy (``current``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from tensordict import TensorDict

from core.layout import ENTROPY, ADVANTAGE, LOG_PROB, STATE_VALUE, VALUE_TARGET
from core.losses.config import PPOConfig


LOSS_KEYS = ("loss_policy", "loss_value", "loss_entropy")
DIAGNOSTIC_KEYS = ("approx_kl", "clip_fraction", ENTROPY, "explained_variance")


def ppo_loss(
    behaviour: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
    cfg: PPOConfig,
    mask: torch.Tensor | None = None,
) -> TensorDict:
    """Loss terms and diagnostics of one minibatch; the ``loss_*`` terms are weighted and summed by the caller.

    With ``r = exp(log pi(a|s) - log mu(a|s))`` (``current`` over ``behaviour`` log-probability),
    ``A`` the advantage (standardised over the minibatch's valid entries if ``cfg.normalize_advantage``,
    detail 7) and ``<.>`` the masked mean over valid entries::

        loss_policy  = -< min(r A, clip(r, 1 - clip_eps, 1 + clip_eps) A) >                 (L^CLIP)
        loss_value   = value_coef * 0.5 * < (V - V_target)^2 >                              (detail 9:
                       with value_clip_eps, max((V - V_t)^2, (V_old + clip(V - V_old, +-eps) - V_t)^2))
        loss_entropy = -entropy_coef * < H >                                                 (detail 10)

    Diagnostics (detached): ``approx_kl = <(r - 1) - log r>`` (Schulman's unbiased low-variance
    estimator, detail 12), ``clip_fraction = <|r - 1| > clip_eps>``, ``entropy = <H>``, and
    ``explained_variance = 1 - Var[V_target - V] / Var[V_target]`` over valid entries (NaN if
    ``Var[V_target] == 0``). The masked mean is ``sum(x * m) / max(sum(m), 1)``, so an all-masked minibatch
    gives zero losses; masked entries (NaN included) change neither values nor gradients of the loss.

    Args:
        behaviour: recorded at acting time: ``log_prob``, ``state_value``, ``advantage``, ``value_target``,
            all of one shape ``[N, A, 1]`` (or ``[N, 1]``). A TensorDict or any mapping.
        current: the same samples re-evaluated by the policy being trained: ``log_prob``, ``state_value``,
            ``entropy``, same shape, carrying gradients.
        cfg: PPO hyper-parameters.
        mask: bool ``[N, A]`` (the shape without the trailing 1), True where the agent is present; None: all.

    Returns:
        A TensorDict with batch ``[]``: ``loss_policy``, ``loss_value``, ``loss_entropy`` (with gradients)
        and detached ``approx_kl``, ``clip_fraction``, ``entropy``, ``explained_variance``.

    Raises:
        ValueError: if an entry's shape differs from ``behaviour["advantage"]`` or the mask does not fit it.
    """
    adv = behaviour[ADVANTAGE]
    check_shapes(adv.shape, behaviour, current, mask)
    loss_policy, loss_value, loss_entropy, log_ratio = loss_terms(
        adv, behaviour[LOG_PROB], behaviour[STATE_VALUE], behaviour[VALUE_TARGET],
        current[LOG_PROB], current[STATE_VALUE], current[ENTROPY], mask, cfg, sanitize=True,
    )
    target = behaviour[VALUE_TARGET]
    if mask is not None:
        target = torch.where(mask.unsqueeze(-1), target, 0.0)
    kl, clip_fraction, entropy, ev = diagnostics(
        log_ratio, current[STATE_VALUE].detach(), target, current[ENTROPY].detach(), mask, cfg
    )
    return TensorDict(
        loss_policy=loss_policy, loss_value=loss_value, loss_entropy=loss_entropy,
        approx_kl=kl, clip_fraction=clip_fraction, entropy=entropy, explained_variance=ev,
    )


def loss_terms(
    adv: torch.Tensor,
    old_log_prob: torch.Tensor,
    old_value: torch.Tensor,
    value_target: torch.Tensor,
    log_prob: torch.Tensor,
    value: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor | None,
    cfg: PPOConfig,
    *,
    sanitize: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three loss terms of :func:`ppo_loss` and the detached log-ratio, on shape-checked tensors.

    The hot path of :func:`core.losses.update.ppo_update_`: no diagnostics, no container. With
    ``sanitize=False`` the caller guarantees the behaviour tensors are finite at masked entries.

    Returns:
        ``(loss_policy, loss_value, loss_entropy, log_ratio.detach())``.
    """
    if mask is not None:
        valid = mask.unsqueeze(-1)
        count = valid.sum().clamp_min(1)
        if sanitize:  # padding may hold NaN; where() keeps it out of values and gradients
            adv, old_log_prob, old_value, value_target = (
                torch.where(valid, x, 0.0) for x in (adv, old_log_prob, old_value, value_target)
            )
    log_ratio = log_prob - old_log_prob
    if mask is not None:  # exp() of a large padded log-ratio would turn the masked-out gradient into 0 * inf
        log_ratio = torch.where(valid, log_ratio, 0.0)
    ratio = log_ratio.exp()
    if cfg.normalize_advantage:
        if mask is None:
            adv = _standardized_all(adv, cfg.advantage_eps)
        else:
            adv = _standardized(adv, valid, count, cfg.advantage_eps)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv)
    value_err = (value - value_target).square()
    if cfg.value_clip_eps is not None:
        clipped = old_value + (value - old_value).clamp(-cfg.value_clip_eps, cfg.value_clip_eps)
        value_err = torch.maximum(value_err, (clipped - value_target).square())
    if mask is None:
        loss_policy, value_mean = -surrogate.mean(), value_err.mean()
    else:
        loss_policy = -torch.where(valid, surrogate, 0.0).sum() / count
        value_mean = torch.where(valid, value_err, 0.0).sum() / count
    loss_value = (0.5 * cfg.value_coef) * value_mean
    if cfg.entropy_coef == 0.0:  # config branch: no backward pass through an unused entropy graph
        loss_entropy = torch.zeros((), dtype=value_mean.dtype, device=value_mean.device)
    elif mask is None:
        loss_entropy = -cfg.entropy_coef * entropy.mean()
    else:
        loss_entropy = -cfg.entropy_coef * torch.where(valid, entropy, 0.0).sum() / count
    return loss_policy, loss_value, loss_entropy, log_ratio.detach()


@torch.no_grad()
def diagnostics(
    log_ratio: torch.Tensor,
    value: torch.Tensor,
    value_target: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor | None,
    cfg: PPOConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(approx_kl, clip_fraction, entropy, explained_variance)`` over valid entries (see :func:`ppo_loss`).

    Inputs ``[N, A, 1]`` (any common shape), ``value_target`` finite; mask ``[N, A]`` or None. Computed in
    float64 from :func:`diagnostic_moments` (the terms PPO's update merges over its steps), returned in the
    inputs' dtype; explained variance is NaN where the valid targets do not vary.
    """
    moments = diagnostic_moments(log_ratio, value, value_target, entropy, mask, cfg)
    return tuple(moment_diagnostics(moments, dtype=log_ratio.dtype).unbind())


def diagnostic_moments(
    log_ratio: torch.Tensor,
    value: torch.Tensor,
    value_target: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor | None,
    cfg: PPOConfig,
) -> torch.Tensor:
    """:func:`diagnostics` as mergeable moments: ``[8]`` float64 over the valid entries: the count ``n``; the
    sums of the approximate KL, of the clipped indicator and of the entropy; the means of the value target
    and of the value error; their sums of squared deviations. Parts of one batch (PPO's epochs) merge with
    :func:`merge_moments`; :func:`moment_diagnostics` turns the result into :func:`diagnostics`' values.
    Inputs as :func:`diagnostics`. One vectorised pass (it runs once per epoch of every update)."""
    f64 = torch.float64
    lr, target = log_ratio.to(f64), value_target.to(f64)
    ratio_m1 = lr.exp() - 1.0
    x = torch.stack((ratio_m1 - lr, (ratio_m1.abs() > cfg.clip_eps).to(f64), entropy.to(f64), target,
                     target - value.to(f64))).reshape(5, -1)
    if mask is None:
        valid = None
        n = torch.full((1,), float(x.shape[1]), dtype=f64, device=x.device)
    else:
        valid = mask.unsqueeze(-1).expand_as(log_ratio).reshape(1, -1)
        x = torch.where(valid, x, 0.0)
        n = valid.sum(1).to(f64)
    sums = x.sum(1)
    means = sums[3:] / n.clamp_min(1.0)
    deviations = x[3:] - means.unsqueeze(1)
    if valid is not None:
        deviations = torch.where(valid, deviations, 0.0)
    return torch.cat((n, sums[:3], means, deviations.square().sum(1)))


def merge_moments(parts: torch.Tensor) -> torch.Tensor:
    """``[K, 8]`` :func:`diagnostic_moments` of parts of a batch as those of the whole ``[8]``: counts and sums
    add; means are count-weighted; squared deviations add, plus each part's ``n_i (mean_i - mean)^2``."""
    counts = parts[:, 0]
    n = counts.sum(0, keepdim=True)
    means = parts[:, 4:6]
    mean = (counts.unsqueeze(1) * means).sum(0) / n.clamp_min(1.0)
    spread = (counts.unsqueeze(1) * (means - mean).square()).sum(0)
    return torch.cat((n, parts[:, 1:4].sum(0), mean, parts[:, 6:8].sum(0) + spread))


def moment_diagnostics(moments: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(approx_kl, clip_fraction, entropy, explained_variance)`` as :func:`diagnostics` gives them, stacked
    ``[4]`` in ``dtype``, from (merged) :func:`diagnostic_moments`."""
    n = moments[0].clamp_min(1.0)
    var_target, var_err = moments[6] / n, moments[7] / n
    ev = torch.where(var_target > 0, 1.0 - var_err / var_target, torch.nan)
    return torch.cat((moments[1:4] / n, ev.reshape(1))).to(dtype)


def check_shapes(
    shape: torch.Size,
    behaviour: Mapping[str, torch.Tensor],
    current: Mapping[str, torch.Tensor],
    mask: torch.Tensor | None,
) -> None:
    """Raises ValueError unless every input of :func:`ppo_loss` has ``shape`` (mask: ``shape[:-1]``, bool)."""
    if len(shape) < 2 or shape[-1] != 1:
        raise ValueError(f"advantage must be [N, ..., 1], got {list(shape)}")
    for name, td, keys in (("behaviour", behaviour, (LOG_PROB, STATE_VALUE, VALUE_TARGET)),
                           ("current", current, (LOG_PROB, STATE_VALUE, ENTROPY))):
        for key in keys:
            if td[key].shape != shape:
                raise ValueError(f"{name}[{key!r}]: expected shape {list(shape)}, got {list(td[key].shape)}")
    if mask is not None and (mask.shape != shape[:-1] or mask.dtype != torch.bool):
        raise ValueError(f"mask: expected bool {list(shape[:-1])}, got {mask.dtype} {list(mask.shape)}")


def _standardized(adv: torch.Tensor, valid: torch.Tensor, count: torch.Tensor, eps: float) -> torch.Tensor:
    """``(adv - mean) / (std + eps)`` over valid entries (unbiased std; one valid entry gives 0)."""
    mean = adv.sum() / count  # adv is 0 at masked entries
    centered = torch.where(valid, adv - mean, 0.0)
    std = (centered.square().sum() / (count - 1).clamp_min(1)).sqrt()
    return centered / (std + eps)


def _standardized_all(adv: torch.Tensor, eps: float) -> torch.Tensor:
    if adv.numel() == 1:  # shape branch, no sync: a lone advantage carries no signal once centred
        return torch.zeros_like(adv)
    return (adv - adv.mean()) / (adv.std() + eps)
